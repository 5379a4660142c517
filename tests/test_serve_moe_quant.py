"""Quantized experts of tiny Qwen3-MoE and Mixtral checkpoints, quantized by lowbit's format registry in modelopt's
per-expert layout (the rest 16-bit): W4A16 INT4 with per-expert AWQ pre_quant_scales, static per-tensor FP8 with
per-expert input scales, FP8 with per-channel weights and per-token activations, INT8 W8A8 SmoothQuant with
per-expert pre_quant_scales and input scales. The engine against the reference
reader, and the loader's refusal of gate and up that do not share their smoothing."""
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3MoeConfig

from lowbit import formats
from lowbit.formats.w4a16_awq import W4A16_AWQ
from lowbit.formats.w8a8_sq import W8A8_SQ_PER_CHANNEL
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.auto_write import write_mixed
from lowbit.serve import LLM
from test_serve_engine import check_against_reference

torch.set_num_threads(1)
EXPERTS, GROUP = 4, 32
SHAPES = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.05,
              tie_word_embeddings=False, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": (Qwen3MoeConfig(moe_intermediate_size=32, num_experts=EXPERTS, **SHAPES), "mlp.experts",
                  ("gate_proj", "up_proj", "down_proj")),
    "mixtral": (MixtralConfig(**dict(SHAPES, intermediate_size=32), num_local_experts=EXPERTS),
                "block_sparse_moe.experts", ("w1", "w3", "w2")),
}


def quantize_part(fmt, w, e: int, part: int, smooth):
    """One expert linear's on-disk tensors: INT4 with `smooth` as pre_quant_scale; FP8 static with an input scale
    per expert (gate and up share it, down has its own); FP8 per token as the format quantizes it; INT8 SmoothQuant
    with both."""
    if fmt is W4A16_AWQ:
        return fmt.quantize(w, group=GROUP, smooth=smooth.clone())
    x_amax = (1.0 + 0.5 * e) if part < 2 else (0.2 + 0.1 * e)
    if fmt is W8A8_SQ_PER_CHANNEL:
        return fmt.quantize(w, smooth=smooth.clone(), x_amax=x_amax)
    return fmt.quantize(w, x_amax=x_amax)


def experts_checkpoint(out, family: str, fmt=W4A16_AWQ, unmergeable: bool = False):
    """A float tiny model of `family` with every expert linear of format fmt (INT4: group 32, gate and up sharing a
    random pre_quant_scale per expert, unmergeable: expert 1's up gets its own, down its own)."""
    torch.manual_seed(0)
    cfg, experts, parts = CONFIGS[family]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))
    src = out.parent / f"{out.name}-float"  # transformers' own per-expert names and weights
    model.save_pretrained(src)
    float_tensors = load_file(src / "model.safetensors")
    shutil.rmtree(src)
    g = torch.Generator().manual_seed(1)
    layer_tensors, entries = {}, {}
    for layer in range(cfg.num_hidden_layers):
        for e in range(EXPERTS):
            base = f"model.layers.{layer}.{experts}.{e}"
            smooth_in = 0.5 + torch.rand(cfg.hidden_size, generator=g)
            for part in parts:
                w = float_tensors[f"{base}.{part}.weight"]
                smooth = smooth_in if part != parts[2] else 0.5 + torch.rand(w.shape[1], generator=g)
                if unmergeable and e == 1 and part == parts[1]:
                    smooth = smooth * 1.5
                layer_tensors[f"{base}.{part}"] = quantize_part(fmt, w, e, parts.index(part), smooth)
                entries[f"{base}.{part}"] = {"quant_algo": fmt.name, "group_size": GROUP}
    recipe = {"name": f"synthetic-{fmt.name.lower()}", "quant_algo": fmt.name}
    return write_mixed(model, tok, layer_tensors, entries, out, source=family, recipe=recipe)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_int4_engine_matches_reader(family, tmp_path):
    path = experts_checkpoint(tmp_path / family, family)
    llm = check_against_reference(path, max_num_tokens=16)
    layer = llm.engine.runner.model.model.layers[0]
    experts = getattr(layer, layer.mlp_name).experts
    assert experts.w13.dtype == torch.uint8 and experts.int4.w13_scale.shape == (EXPERTS, 2 * 32, 64 // GROUP)
    assert experts.int4.w13_smooth.unique().numel() > 64  # each expert's own smoothing reached the layer


def test_gate_and_up_with_different_smoothing_are_refused(tmp_path):
    path = experts_checkpoint(tmp_path / "split", "qwen3_moe", unmergeable=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1: gate and up have different input"):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", [formats.FP8, formats.FP8_PER_CHANNEL_PER_TOKEN], ids=lambda f: f.name)
def test_fp8_engine_matches_reader(family, fmt, tmp_path):
    path = experts_checkpoint(tmp_path / family, family, fmt)
    llm = check_against_reference(path, max_num_tokens=16)
    layer = llm.engine.runner.model.model.layers[0]
    experts = getattr(layer, layer.mlp_name).experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.fp8.w13_scale.shape == (EXPERTS, 64)
    static = fmt is formats.FP8
    assert (experts.fp8.a13_scale is not None) == static
    if static:  # each expert's own input scale
        assert experts.fp8.a13_scale.unique().numel() == EXPERTS
    else:  # per channel: scales differ within an expert's rows
        assert experts.fp8.w13_scale[0].unique().numel() > 2


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_int8_engine_matches_reader(family, tmp_path):
    path = experts_checkpoint(tmp_path / family, family, W8A8_SQ_PER_CHANNEL)
    llm = check_against_reference(path, max_num_tokens=16)
    layer = llm.engine.runner.model.model.layers[0]
    experts = getattr(layer, layer.mlp_name).experts
    assert experts.w13.dtype == torch.int8 and experts.int8.w13_scale.shape == (EXPERTS, 64)
    assert experts.int8.a13_scale.unique().numel() == EXPERTS  # each expert's own input scale
    assert experts.int8.w13_smooth.unique().numel() > 64  # and its own smoothing
