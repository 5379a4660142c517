"""Merged q/k/v and gate/up linears: one layer over the merged checkpoint tensors equals the parts side by side."""
import pytest
import torch

from lowbit import formats
from lowbit.kernels import linear_ref, prepare_linear
from lowbit.testing.synthetic import quantize_linear
from lowbit.serve.layers.linear import MergedLinear

SIZES = [96, 32, 32]  # q, k, v rows
K = 128
ALGOS = [None, "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NVFP4"]


def parts_for(algo, seed=0):
    g = torch.Generator().manual_seed(seed)
    smooth = (0.5 + torch.rand(K, generator=g)).to(torch.bfloat16)
    parts = []
    for i, n in enumerate(SIZES):
        w = (i + 1) * 0.02 * torch.randn(n, K, generator=g)  # unequal ranges: unequal per-tensor scales
        if algo is None:
            parts.append({"weight": w.to(torch.bfloat16)})
        else:
            kwargs = {"smooth": smooth} if algo in ("W8A8_SQ_PER_CHANNEL", "W4A16_AWQ") else {}
            parts.append(quantize_linear(algo, w, group=64, w_amax=0.2, **kwargs) if algo == "NVFP4" else
                         quantize_linear(algo, w, group=64, **kwargs))
    return parts


@pytest.mark.parametrize("algo", ALGOS)
def test_merged_layer_equals_parts_side_by_side(algo):
    parts = parts_for(algo)
    merged = formats.get(algo).merge(parts)
    assert merged is not None
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = torch.cat([linear_ref(x, prepare_linear(algo, p, "cpu")) for p in parts], dim=-1).float()
    got = linear_ref(x, prepare_linear(algo, merged, "cpu")).float()
    # fp32 math on the same dequantized weights; only the GEMM's blocking may differ, then rounding to bf16
    assert ((got - expected).norm() / expected.norm()).item() < 1e-3
    assert (got == expected).float().mean().item() > 0.99
    layer = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"])  # the loader's path: merged by the format
    layer.load([algo] * 3, parts, "cpu", torch.bfloat16)
    assert layer.parts is None and torch.equal(layer(x).float(), got)


def test_fp8_unequal_weight_scales_become_per_row_and_stay_exact():
    parts = parts_for("FP8")
    assert len({p["weight_scale"].item() for p in parts}) == 3
    merged = formats.FP8.merge(parts)
    assert merged["weight_scale"].shape == (sum(SIZES), 1)
    assert torch.equal(merged["weight"].view(torch.uint8), torch.cat([p["weight"] for p in parts]).view(torch.uint8))
    assert merged["weight_scale"][SIZES[0], 0] == parts[1]["weight_scale"]


@pytest.mark.parametrize("algo, name", [("FP8", "input_scale"), ("W4A16_AWQ", "pre_quant_scale"),
                                        ("NVFP4", "weight_scale_2")])
def test_unequal_shared_scales_are_not_merged(algo, name):
    parts = parts_for(algo)
    parts[1][name] = parts[1][name] * 2
    assert formats.get(algo).merge(parts) is None


def test_merged_linear_falls_back_to_parts():
    parts = parts_for("FP8")
    parts[2]["input_scale"] = parts[2]["input_scale"] * 2  # cannot share one quantized input
    layer = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"])
    layer.load(["FP8"] * 3, parts, "cpu", torch.bfloat16)
    assert layer.parts is not None and layer.fp8_input_scale is None
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = torch.cat([linear_ref(x, prepare_linear("FP8", p, "cpu")) for p in parts], dim=-1)
    assert torch.equal(layer(x), expected)
    mixed = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"])
    mixed.load(["FP8", "FP8", None], parts[:2] + [parts_for(None)[2]], "cpu", torch.bfloat16)
    assert mixed.parts is not None and mixed(x).shape == (3, sum(SIZES))


def with_bias(parts, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [dict(p, bias=torch.randn(n, generator=g).to(torch.bfloat16)) for p, n in zip(parts, SIZES)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-3)])
def test_fp8_deferred_part_scales_run_per_tensor_and_restore_the_parts(bias, dtype, tol):
    parts = parts_for("FP8")
    parts = with_bias(parts) if bias else parts
    layer = MergedLinear(K, SIZES, bias, ["q_proj", "k_proj", "v_proj"], defer_part_scales=True)
    layer.load(["FP8"] * 3, parts, "cpu", dtype, defer=True)
    s = [p["weight_scale"].float() for p in parts]
    assert layer.parts is None and layer.merged.prepared.source["weight_scale"].numel() == 1  # per-tensor
    assert layer.part_scales.dtype == torch.float32
    assert torch.equal(layer.part_scales, torch.stack([s[0] / s[0], s[1] / s[0], s[2] / s[0]]))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = torch.cat([linear_ref(x, prepare_linear("FP8", p, "cpu"), p.get("bias"), out_dtype=torch.float32)
                          for p in parts], dim=-1)
    per_col = torch.cat([r.expand(n) for r, n in zip(layer.part_scales, SIZES)])
    got = layer(x).float() * per_col
    # fp32: the file's tolerance; bf16: the merged output (and bias) rounded to bf16 before the ratio, rms ~2^-9
    assert ((got - expected).norm() / expected.norm()).item() < tol
    assert ((layer(x).float() - expected).norm() / expected.norm()).item() > 0.3  # unscaled output is off


def test_deferral_only_where_asked_and_needed():
    parts = parts_for("FP8")
    plain = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"])
    plain.load(["FP8"] * 3, parts, "cpu", torch.bfloat16)
    assert plain.part_scales is None and plain.merged.prepared.source["weight_scale"].shape == (sum(SIZES), 1)
    with pytest.raises(ValueError, match="does not apply"):
        plain.load(["FP8"] * 3, parts, "cpu", torch.bfloat16, defer=True)
    layer = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"], defer_part_scales=True)
    layer.load(["FP8"] * 3, parts, "cpu", torch.bfloat16)  # default: CUDA only
    assert layer.part_scales is None and layer.merged.prepared.source["weight_scale"].shape == (sum(SIZES), 1)
    equal = [dict(p, weight_scale=parts[0]["weight_scale"]) for p in parts]
    layer.load(["FP8"] * 3, equal, "cpu", torch.bfloat16, defer=True)
    assert layer.part_scales is None
    for algo in ALGOS:
        if algo != "FP8":
            layer.load([algo] * 3, parts_for(algo), "cpu", torch.bfloat16, defer=True)
            assert layer.part_scales is None, algo
    mixed = dict(parts[2], input_scale=parts[2]["input_scale"] * 2)  # not merged: the parts run exact
    layer.load(["FP8"] * 3, parts[:2] + [mixed], "cpu", torch.bfloat16, defer=True)
    assert layer.parts is not None and layer.part_scales is None


CONFIG = {"hidden_size": 128, "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def _load_fp8(merged_linear, seed, defer):
    g = torch.Generator().manual_seed(seed)
    parts = [quantize_linear("FP8", (i + 1) * 0.02 * torch.randn(n, CONFIG["hidden_size"], generator=g))
             for i, n in enumerate(merged_linear.out_sizes)]
    if merged_linear.merged.has_bias:
        parts = [dict(p, bias=torch.randn(n, generator=g)) for p, n in zip(parts, merged_linear.out_sizes)]
    merged_linear.load(["FP8"] * len(parts), parts, "cpu", torch.float32, defer=defer)


class _Recorder:
    """An attention backend recording the q, k, v that rotary_store_kv stores (the torch backend's rotary_qk_ref)."""

    def __init__(self, out: dict, key):
        self.out, self.key = out, key

    def rotary_store_kv(self, qkv, hq, hk, positions, cos_sin_cache, part_scales, kv_cache, slot_mapping, k_scale,
                        v_scale, qk_norm=None):
        from lowbit.kernels import qk_norm_ref, rotary_qk_ref
        if qk_norm is not None:
            qkv = qk_norm_ref(qkv, hq, hk, cos_sin_cache.shape[-1], qk_norm)
        return self.out.setdefault(self.key, rotary_qk_ref(qkv, hq, hk, positions, cos_sin_cache, part_scales))[0]

    def attend(self, q, *_):
        return q


@pytest.mark.parametrize("attn_kwargs", [{}, {"qkv_bias": True}, {"qk_norm": True}])
def test_llama_blocks_apply_the_deferred_part_scales(attn_kwargs, monkeypatch):
    from lowbit.serve.layers import attention
    from lowbit.serve.layers.rotary import RotaryEmbedding
    from lowbit.serve.models.llama import LlamaAttention, LlamaMLP

    rotary = RotaryEmbedding(CONFIG, 32, 64)
    x = torch.randn(6, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(5))
    ctx = type("Ctx", (), {"positions": torch.arange(6), "slot_mapping": torch.arange(6),
                           "for_kind": lambda self, kind: self})()  # one KV kind
    qkv_out, mlp_out = {}, {}
    attn_defers = not attn_kwargs.get("qk_norm")  # Qwen3's RMSNorm before RoPE would absorb a ratio: per-row
    for defer in (False, True):
        attn, mlp = LlamaAttention(CONFIG, rotary, **attn_kwargs), LlamaMLP(CONFIG)
        assert attn.qkv_proj.defer_part_scales == attn_defers and mlp.gate_up_proj.defer_part_scales
        _load_fp8(attn.qkv_proj, 1, defer and attn_defers)
        _load_fp8(mlp.gate_up_proj, 2, defer)
        attn.o_proj.load(None, {"weight": torch.eye(128)}, "cpu", torch.float32)
        mlp.down_proj.load(None, {"weight": torch.eye(128, 192)}, "cpu", torch.float32)
        assert (attn.qkv_proj.part_scales is not None) == (defer and attn_defers)
        assert (mlp.gate_up_proj.part_scales is not None) == defer
        monkeypatch.setattr(attention, "_backend", _Recorder(qkv_out, defer))
        attn(x, ctx)
        mlp_out[defer] = mlp(x)
    (ref, got), (mlp_ref, mlp_got) = qkv_out.values(), mlp_out.values()
    for a, b in zip(got, ref):  # fp32 throughout: the ratios restore the parts to rounding
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert ((mlp_got - mlp_ref).norm() / mlp_ref.norm()).item() < 1e-5
