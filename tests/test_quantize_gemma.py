"""Gemma 2 / Gemma 3 through the recipes on tiny random models: modelopt calibrates and exports; lowbit's reader
matches modelopt's fake-quant model, and the engine matches the reader."""
import shutil

import pytest
import torch

from lowbit.calibrate.data import load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import load_reference_model, read
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe
from lowbit.serve import LLM, SamplingParams

torch.set_num_threads(1)
# the tokenizer's vocabulary (calibration text is tokenized with it); in-features multiples of 128 (AWQ groups)
TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32)
NOISE_FACTOR = 1.25  # the reader is no farther from modelopt's fake quant than the float model, within this factor
LAYER_REL = 1e-4  # one linear, reader vs modelopt's QuantLinear on the same input (relative L2)
# Linears whose export is their fake quant as calibrated. AWQ's q/k/v and gate/up are re-smoothed to one shared
# pre_quant_scale at export (folded into the (1 + weight) norm before them) and requantized, so the whole model
# differs from the fake-quant one by independent rounding noise: compared statistically (NOISE_FACTOR).
CHECKED_LAYERS = ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj")
PROMPT_TOL = 2e-3  # nats: engine vs reader prompt logprobs (the same dequantized math, float rounding apart)


def tiny_gemma(family: str, path):
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    config = Gemma2Config(**TINY) if family == "gemma2" else Gemma3TextConfig(**TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=[("gemma3", "fp8"), ("gemma3", "int4_awq"), ("gemma2", "fp8")],
                ids=lambda p: "-".join(p))
def run(request, tmp_path_factory):
    family, recipe_name = request.param
    src = tiny_gemma(family, tmp_path_factory.mktemp(family))
    recipe = with_calibration(load_recipe(recipe_name), num_samples=4, seq_len=64)
    model, tok = load_float_model(src)
    test_ids = torch.tensor(token_batches(tok, load_texts(recipe.calibration.data), 1, 64, seed=7))
    with torch.no_grad():
        float_logits = model(test_ids).logits
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant_logits = model(test_ids).logits
        layer_io = {}
        for name in CHECKED_LAYERS:
            module = model.get_submodule(name)
            x = torch.randn(3, 7, module.in_features, generator=torch.Generator().manual_seed(1))
            layer_io[name] = (x, module(x))
    out = tmp_path_factory.mktemp("ckpt") / f"{family}-{recipe_name}"
    export(model, tok, recipe, out, source=family)
    return {"out": out, "ids": test_ids, "float": float_logits, "fake_quant": fake_quant_logits, "layer_io": layer_io}


def test_every_decoder_linear_is_quantized_and_the_rest_float(run):
    ckpt = read(run["out"])
    layers = [f"model.layers.{i}.{m}" for i in range(2) for m in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")]
    assert all(ckpt.layer_algo(n) is not None for n in layers)
    assert ckpt.layer_algo("lm_head") is None
    tensors = ckpt.tensors()
    assert tensors["model.layers.0.pre_feedforward_layernorm.weight"].is_floating_point()


def test_reader_matches_modelopt_fake_quant(run):
    model, _ = load_reference_model(run["out"])
    with torch.no_grad():
        for name, (x, expected) in run["layer_io"].items():
            assert rel_l2(model.get_submodule(name)(x), expected) < LAYER_REL, name
        logits = model(run["ids"]).logits
    ref = run["fake_quant"]
    reader_gap, quant_gap = rel_l2(logits, ref), rel_l2(run["float"], ref)
    print(f"logits rel-L2 to modelopt fake quant: reader {reader_gap:.4f}, float model {quant_gap:.4f}")
    assert quant_gap > 1e-3  # the quantization is visible at all
    assert reader_gap < NOISE_FACTOR * quant_gap


def test_engine_matches_reader(run):
    model, _ = load_reference_model(run["out"])
    ids = run["ids"][0, :40].tolist()  # longer than the window
    llm = LLM(str(run["out"]), num_kv_blocks=32)
    out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, ignore_eos=True))[0]
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert [e[0] for e in out.prompt_logprobs[1:]] == pytest.approx(
        [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=PROMPT_TOL)
    seq = ids + out.outputs[0].token_ids  # each greedy token is the reader's argmax (teacher-forced)
    with torch.no_grad():
        lp = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    for pos in range(len(ids) - 1, len(seq) - 1):
        assert lp[pos, seq[pos + 1]].item() >= lp[pos].max().item() - PROMPT_TOL
