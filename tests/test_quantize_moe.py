"""FP8 calibration and export of a tiny Qwen3-MoE whose calibration routes no token to one expert: every expert linear
is exported as modelopt does (per-expert gate/up/down with per-tensor scales), every scale finite and positive, the
router gate left unquantized.

How an unrouted expert gets valid scales (modelopt 0.47's MoE export, checked here): its weight scale is its
weight's amax / 448 (weight-only, no tokens needed; gate and up share the larger); its input scales are the maximum
over the layer's experts."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from lowbit.calibrate.data import load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import read
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe

torch.set_num_threads(1)
EXPERTS, UNROUTED = 8, 3
PARTS = ("gate_proj", "up_proj", "down_proj")


def never_route(expert: int):
    """A forward hook for transformers' Qwen3MoeTopKRouter: its top-k as before, with `expert` masked out."""
    def hook(router, args, out):
        logits = F.linear(args[0].reshape(-1, router.hidden_dim), router.weight)
        masked = logits.masked_fill(torch.arange(logits.shape[-1]) == expert, float("-inf"))
        weights, ids = torch.topk(torch.softmax(masked, -1, dtype=torch.float), router.top_k, -1)
        return logits, weights.to(logits.dtype), ids
    return hook


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("qwen3_moe")
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.05)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    recipe = with_calibration(load_recipe("fp8"), num_samples=4, seq_len=64)
    model, tok = load_float_model(src)
    routed = torch.zeros(EXPERTS, dtype=torch.long)

    def count(router, args, out):
        routed.add_(torch.bincount(out[2].reshape(-1), minlength=EXPERTS))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(never_route(UNROUTED))
        layer.mlp.gate.register_forward_hook(count)
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    out = tmp_path_factory.mktemp("ckpt") / "qwen3_moe-fp8"
    export(model, tok, recipe, out, source="qwen3_moe")
    return out, routed, src


def test_unrouted_expert_still_gets_valid_scales(exported):
    out, routed, src = exported
    assert routed[UNROUTED] == 0 and (routed > 0).sum() == EXPERTS - 1
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(src / "model.safetensors", "pt") as source:
        for layer in range(2):
            for part in PARTS:
                base = f"model.layers.{layer}.mlp.experts"
                w_scales = torch.stack([f.get_tensor(f"{base}.{e}.{part}.weight_scale") for e in range(EXPERTS)])
                x_scales = torch.stack([f.get_tensor(f"{base}.{e}.{part}.input_scale") for e in range(EXPERTS)])
                assert bool(torch.isfinite(w_scales).all() and (w_scales > 0).all()), (layer, part, w_scales)
                assert bool(torch.isfinite(x_scales).all() and (x_scales > 0).all()), (layer, part, x_scales)
                assert f.get_tensor(f"{base}.{UNROUTED}.{part}.weight").dtype == torch.float8_e4m3fn
                # weight-only: amax / 448 of the float weight (gate and up share the larger of their two)
                shared = ("gate_proj", "up_proj") if part != "down_proj" else (part,)
                amax = max(source.get_tensor(f"{base}.{UNROUTED}.{p}.weight").abs().max() for p in shared)
                assert torch.isclose(w_scales[UNROUTED], amax / 448, rtol=1e-5), (part, w_scales[UNROUTED], amax)
                others = torch.cat([x_scales[:UNROUTED], x_scales[UNROUTED + 1:]])
                assert torch.isclose(x_scales[UNROUTED], others.max())


def test_router_gate_stays_16_bit(exported):
    out, _, _ = exported
    ckpt = read(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        for layer in range(2):
            assert ckpt.layer_algo(f"model.layers.{layer}.mlp.gate") is None
            assert f.get_tensor(f"model.layers.{layer}.mlp.gate.weight").dtype == torch.float32
            assert ckpt.layer_algo(f"model.layers.{layer}.mlp.experts.0.down_proj") is not None
