"""int4_awq calibration and export of a tiny Qwen3-MoE whose calibration routes no token to one expert, through
modelopt 0.47 with lowbit.quantize.moe_export's repairs: every expert linear exported per expert as INT4 with finite,
positive group scales (the unrouted one's too), the router gate 16-bit; lowbit's reader against modelopt's
fake-quant model; the engine against the reader.

How the experts are calibrated (modelopt 0.47 on transformers' fused experts): AWQ's search does not reach them (their
input quantizers are disabled and get no pre_quant_scale), so every expert's weight is quantized from its own
weight's group amax / 7 (round to nearest): weight-only, no tokens needed, so an unrouted expert is like any other."""
import dataclasses
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from lowbit.calibrate.data import builtin_texts, load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import load_reference_model, read
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe
from test_quantize_moe import EXPERTS, PARTS, UNROUTED, never_route
from test_serve_engine import check_against_reference
from test_serve_moe_fp8 import READER_REL

torch.set_num_threads(1)
GROUP = 128  # the recipe's; the experts' in-features (128) are one group


def calibrate_and_export(tmp_path_factory, recipe_name: str):
    """A tiny Qwen3-MoE (hidden and moe_intermediate 128) calibrated with one expert unrouted and exported by
    `recipe_name` with attention left 16-bit -> (checkpoint, the float source, held-out tokens, modelopt's
    fake-quant logits on them)."""
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("qwen3_moe")
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=128, intermediate_size=96, moe_intermediate_size=128,
                         num_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.05,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    # attention left 16-bit: modelopt's export re-smooths AWQ q/k/v to one averaged pre_quant_scale and re-quantizes
    # them, so its fake-quant model and its checkpoint differ there by design; the experts are what is compared
    recipe = dataclasses.replace(with_calibration(load_recipe(recipe_name), num_samples=4, seq_len=64),
                                 exclude=("lm_head", "*self_attn*"))
    model, tok = load_float_model(src)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(never_route(UNROUTED))
    heldout = token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0)
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant_logits = model(torch.tensor(heldout)).logits
    out = tmp_path_factory.mktemp("ckpt") / f"qwen3_moe-{recipe_name}"
    export(model, tok, recipe, out, source="qwen3_moe")
    return out, src, heldout, fake_quant_logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return calibrate_and_export(tmp_path_factory, "int4_awq")


def test_every_expert_exported_as_int4_with_valid_scales(exported):
    out, src, _, _ = exported
    ckpt = read(out)
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(src / "model.safetensors", "pt") as source:
        for layer in range(2):
            base = f"model.layers.{layer}.mlp.experts"
            assert ckpt.layer_algo(f"model.layers.{layer}.mlp.gate") is None
            for e in range(EXPERTS):
                for part in PARTS:
                    w, s = f.get_tensor(f"{base}.{e}.{part}.weight"), f.get_tensor(f"{base}.{e}.{part}.weight_scale")
                    assert w.dtype == torch.uint8 and tuple(w.shape) == (64, 128) and tuple(s.shape) == (128, 1)
                    assert bool(torch.isfinite(s).all() and (s > 0).all()), (layer, e, part)
                    assert ckpt.layer_algo(f"{base}.{e}.{part}") == ckpt.quant_algo
            for part in PARTS:  # the unrouted expert: its weight's own amax / 7 per row (one group)
                amax = source.get_tensor(f"{base}.{UNROUTED}.{part}.weight").abs().amax(1, keepdim=True)
                assert torch.allclose(f.get_tensor(f"{base}.{UNROUTED}.{part}.weight_scale"), amax / 7, rtol=1e-5)


def test_reader_matches_modelopt_fake_quant(exported):
    check_reader(exported)


def check_reader(exported):
    out, _, heldout, fake_quant_logits = exported
    model, _ = load_reference_model(out)
    for layer in model.model.layers:  # as modelopt's model ran (the unrouted expert's weights are checked above)
        layer.mlp.gate.register_forward_hook(never_route(UNROUTED))
    with torch.no_grad():
        logits = model(torch.tensor(heldout)).logits
    err = ((logits - fake_quant_logits).norm() / fake_quant_logits.norm()).item()
    assert err < READER_REL, err


def test_engine_matches_reader(exported):
    llm = check_against_reference(exported[0], max_num_tokens=16)
    assert llm.engine.runner.model.model.layers[0].mlp.experts.w13.dtype == torch.uint8
