"""Mistral and Phi-3 (fused qkv_proj / gate_up_proj) through calibration and export on tiny random models: the
checkpoint's layout, lowbit's reader against modelopt's fake-quant model, and the engine against the reader."""
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lowbit.calibrate.data import builtin_texts, load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import load_reference_model, read
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe
from test_serve_engine import check_against_reference

torch.set_num_threads(1)
# the embedded tokenizer's vocabulary, so calibration text tokenizes into the model's range
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.05, tie_word_embeddings=False, max_position_embeddings=256)
# Whole model, reader vs modelopt's fake quant on the same held-out tokens: the reader dequantizes the exported
# tensors and fake-quantizes activations with the exported scales; modelopt computes the same values in another
# order (measured rel-L2 of the logits: 2e-7 to 4e-7); an activation rounding to a neighbouring FP8 value moves it
# by ~1e-3, a wrong scale or layout by far more.
READER_REL = 1e-5
CASES = [("mistral", "fp8"), ("phi3", "fp8"), ("phi3", "int4_awq")]


def hf_config(family: str):
    from transformers import MistralConfig, Phi3Config

    if family == "mistral":
        return MistralConfig(**SMALL, head_dim=32, sliding_window=11)
    half = SMALL["hidden_size"] // SMALL["num_attention_heads"] // 2
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
                "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [4.0] * half}
    return Phi3Config(**SMALL, original_max_position_embeddings=128, rope_parameters=longrope, sliding_window=11,
                      pad_token_id=0, eos_token_id=2, bos_token_id=1)


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def run(request, tmp_path_factory):
    family, recipe_name = request.param
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp(family)
    AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    recipe = with_calibration(load_recipe(recipe_name), num_samples=4, seq_len=64)
    model, tok = load_float_model(src)
    heldout = token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0)
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant_logits = model(torch.tensor(heldout)).logits
    out = tmp_path_factory.mktemp("ckpt") / f"{family}-{recipe_name}"
    export(model, tok, recipe, out, source=family)
    return {"family": family, "recipe": recipe_name, "out": out, "heldout": heldout,
            "fake_quant_logits": fake_quant_logits}


def test_checkpoint_keeps_phi3_linears_fused(run):
    with safe_open(run["out"] / "model.safetensors", "pt") as f:
        names = set(f.keys())
    fused = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}
    split = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"}
    assert (fused <= names, split <= names) == ((True, False) if run["family"] == "phi3" else (False, True))
    ckpt = read(run["out"])
    assert ckpt.layer_algo("lm_head") is None and ckpt.layer_algo("model.layers.1.mlp.down_proj") is not None


def test_reader_matches_modelopt_fake_quant(run):
    model, _ = load_reference_model(run["out"])
    with torch.no_grad():
        logits = model(torch.tensor(run["heldout"])).logits
    err = rel_l2(logits, run["fake_quant_logits"])
    print(f"{run['family']} {run['recipe']}: reader vs modelopt fake quant logits rel-L2 {err:.1e}")
    assert err < READER_REL


def test_engine_matches_reader(run):
    check_against_reference(run["out"], max_num_tokens=16)
