"""The format registry: every Format quantizes, dequantizes, runs its reference linear and merges parts as the
modelopt tensor conventions say; per-layer resolution (exclude_modules, MIXED_PRECISION) and KV formats."""
import pytest
import torch

from lowbit import formats

N, K = 64, 256
# relative Frobenius error of dequantize(quantize(w)) against w for a N(0, 1) weight, by format
TOLERANCE = {"bf16": 3e-3, "FP8": 0.035, "FP8_PER_CHANNEL_PER_TOKEN": 0.035, "W8A8_SQ_PER_CHANNEL": 0.01,
             "W4A16_AWQ": 0.15, "NVFP4": 0.12, "W4A16_NVFP4": 0.12, "W4A16_ZP": 0.12,
             "INT8_PER_CHANNEL_PER_TOKEN": 0.01}


def weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def explicit_dequantize(name: str, t: dict) -> torch.Tensor:
    """The modelopt conventions written out per format, independently of the Format objects."""
    w = t["weight"]
    if name == "bf16":
        return w.float()
    if name == "FP8":
        return w.float() * t["weight_scale"].float()
    if name in ("FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL", "INT8_PER_CHANNEL_PER_TOKEN"):
        return w.float() * t["weight_scale"].float()[:, None]
    if name in ("W4A16_AWQ", "W4A16_ZP"):
        lo, hi = (w & 0xF).to(torch.int16), (w >> 4).to(torch.int16)
        q = torch.stack([lo, hi], dim=1).reshape(-1, w.shape[1])
        q = torch.where(q > 7, q - 16, q).float()
        group = w.shape[1] // t["weight_scale"].shape[1]
        zero = t["weight_zero_point"].float().repeat_interleave(group, dim=1) if name == "W4A16_ZP" else 0
        return (q - zero) * t["weight_scale"].float().repeat_interleave(group, dim=1)
    codes = torch.stack([w & 0xF, w >> 4], dim=-1).reshape(w.shape[0], -1).long()
    mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes & 7]
    values = torch.where(codes >= 8, -mag, mag)
    scale = t["weight_scale"].float().repeat_interleave(16, dim=1) * t["weight_scale_2"].float()
    return values * scale


def explicit_activation(name: str, x: torch.Tensor, t: dict) -> torch.Tensor:
    if "pre_quant_scale" in t:
        x = x * t["pre_quant_scale"].float()
    if name == "FP8":
        s = t["input_scale"].float()
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    if name == "FP8_PER_CHANNEL_PER_TOKEN":
        s = x.abs().amax(dim=-1, keepdim=True) / 448
        return (x / s).to(torch.float8_e4m3fn).float() * s
    if name == "W8A8_SQ_PER_CHANNEL":
        s = t["input_scale"].float()
        return (x / s).round().clamp(-128, 127) * s
    if name == "INT8_PER_CHANNEL_PER_TOKEN":
        s = x.abs().amax(dim=-1, keepdim=True) / 127
        return (x / s).round().clamp(-127, 127) * s
    if name == "NVFP4":
        return formats.fake_quant_nvfp4(x, t["input_scale"].float())  # checked against modelopt in test_formats_nvfp4
    return x


@pytest.mark.parametrize("name", formats.names())
def test_quantize_dequantize_within_tolerance(name):
    fmt = formats.get(name)
    w = weight()
    smooth = torch.rand(K, generator=torch.Generator().manual_seed(1)) + 0.5
    t = fmt.quantize(w, group=128, smooth=smooth if "pre_quant_scale" in fmt.tensors.optional else None)
    assert set(fmt.tensors.required) <= set(t) <= set(fmt.tensors.required + fmt.tensors.optional)
    assert fmt.shape(t) == (N, K)
    deq = fmt.dequantize(t)
    assert deq.dtype == torch.float32 and deq.shape == (N, K)
    assert ((deq - w).norm() / w.norm()).item() < TOLERANCE[name]
    assert torch.equal(deq, explicit_dequantize(name, t))
    assert torch.equal(formats.dequantize_weight(name, t), deq)


@pytest.mark.parametrize("name", formats.names())
def test_reference_linear_equals_explicit_computation(name):
    fmt = formats.get(name)
    t = fmt.quantize(weight(), x_amax=3.0)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    expected = explicit_activation(name, x, t) @ explicit_dequantize(name, t).t() + bias
    torch.testing.assert_close(fmt.reference_linear(x, t, bias), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(formats.reference_linear(name, x, t, bias), expected, rtol=1e-5, atol=1e-5)


def _parts(name: str, bias: bool = True) -> list[dict]:
    """Two linears sharing an input, quantized as modelopt exports them (shared input / global scales equal)."""
    fmt = formats.get(name)
    parts = []
    for seed, (n, amp) in enumerate([(48, 1.0), (16, 3.0)]):
        t = fmt.quantize(weight(seed, n) * amp, w_amax=16.0)
        if bias:
            t["bias"] = torch.randn(n, generator=torch.Generator().manual_seed(10 + seed))
        parts.append(t)
    return parts


@pytest.mark.parametrize("name", formats.names())
def test_merge_equals_concatenated_parts(name):
    fmt = formats.get(name)
    parts = _parts(name)
    merged = fmt.merge(parts)
    assert merged is not None and fmt.shape(merged) == (64, K)
    assert torch.equal(fmt.dequantize(merged), torch.cat([fmt.dequantize(p) for p in parts]))
    assert torch.equal(merged["bias"], torch.cat([p["bias"] for p in parts]))
    assert fmt.part_scales(parts) is None or name == "FP8"


def test_fp8_merge_with_unequal_scales_per_row():
    parts = _parts("FP8")
    assert not torch.equal(parts[0]["weight_scale"], parts[1]["weight_scale"])
    merged = formats.FP8.merge(parts)
    assert merged["weight_scale"].shape == (64, 1)


def test_fp8_merge_with_deferred_part_scales():
    fmt = formats.FP8
    parts = _parts("FP8")
    ratios = fmt.part_scales(parts)
    assert ratios.shape == (2,) and ratios[0] == 1
    assert torch.allclose(ratios[1], parts[1]["weight_scale"] / parts[0]["weight_scale"])
    merged = fmt.merge(parts, ratios)
    assert torch.equal(merged["weight_scale"], parts[0]["weight_scale"])
    rows = torch.cat([torch.ones(48), ratios[1].expand(16)])[:, None]  # part i's rows come out divided by r_i
    expected = torch.cat([fmt.dequantize(p) for p in parts])
    torch.testing.assert_close(fmt.dequantize(merged) * rows, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(merged["bias"] * rows[:, 0], torch.cat([p["bias"] for p in parts]), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="cannot defer"):
        fmt.merge(parts, ratios[:1])
    with pytest.raises(ValueError, match="cannot defer"):
        formats.W4A16_AWQ.merge(_parts("W4A16_AWQ"), ratios)


def test_equal_fp8_scales_merge_per_tensor_and_defer_nothing():
    parts = [formats.FP8.quantize(weight(s, 32), w_amax=None) for s in (0, 0)]
    assert formats.FP8.part_scales(parts) is None
    assert formats.FP8.merge(parts)["weight_scale"].numel() == 1


def test_merge_refuses_unequal_shared_scales_and_unequal_keys():
    parts = _parts("NVFP4", bias=False)
    parts[1]["weight_scale_2"] = parts[1]["weight_scale_2"] * 2
    assert formats.NVFP4.merge(parts) is None
    assert formats.W4A16_AWQ.merge([{"weight": torch.zeros(2, 4, dtype=torch.uint8)}, {}]) is None
    with pytest.raises(ValueError, match="cannot merge"):
        formats.BF16.merge([{"weight": torch.ones(2, 4), "weight_scale": torch.ones(())}] * 2)


def test_layer_format_exclusions_and_mixed_precision():
    quant = {"quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.0.mlp.gate*"]}
    assert formats.layer_format(quant, "lm_head") is None
    assert formats.layer_format(quant, "model.layers.0.mlp.gate_proj") is None
    assert formats.layer_format(quant, "model.layers.0.mlp.up_proj") is formats.FP8
    assert formats.layer_format(quant, "model.layers.1.mlp.gate_proj") is formats.FP8
    assert formats.layer_format(None, "model.layers.0.mlp.up_proj") is None
    mixed = {"quant_algo": "MIXED_PRECISION", "exclude_modules": ["lm_head"],
             "quantized_layers": {"model.layers.0.self_attn.q_proj": {"quant_algo": "W4A16_AWQ", "group_size": 64}}}
    assert formats.layer_format(mixed, "model.layers.0.self_attn.q_proj") is formats.W4A16_AWQ
    assert formats.layer_format(mixed, "model.layers.0.self_attn.k_proj") is None
    assert formats.layer_algo(mixed, "model.layers.0.self_attn.q_proj") == "W4A16_AWQ"
    with pytest.raises(ValueError, match="unsupported quant_algo 'W4A8_AWQ'"):
        formats.layer_format({"quant_algo": "W4A8_AWQ"}, "model.layers.0.mlp.up_proj")


def test_unknown_names_raise_and_list_the_known():
    with pytest.raises(ValueError, match="FP8, FP8_PER_CHANNEL_PER_TOKEN, INT8_PER_CHANNEL_PER_TOKEN, NVFP4"):
        formats.get("INT3")
    assert formats.get(None) is formats.BF16 and formats.get("fp16") is formats.BF16
    with pytest.raises(ValueError, match="kv_cache_quant_algo 'NVFP4'"):
        formats.kv_format("NVFP4")


def test_kv_format():
    kv = formats.kv_format("FP8")
    assert kv.cache_dtype == torch.float8_e4m3fn and kv.scale_names() == {"k": "k_proj.k_scale", "v": "v_proj.v_scale"}
    assert kv.scale_from_amax(torch.tensor(448.0)) == 1.0
    assert formats.kv_format(None) is None


def test_flags_the_kernels_read():
    assert [f.name for f in map(formats.get, formats.names()) if f.static_fp8_input] == ["FP8"]
    per_token = [f.name for f in map(formats.get, formats.names()) if f.dynamic_per_token]
    assert per_token == ["FP8_PER_CHANNEL_PER_TOKEN", "INT8_PER_CHANNEL_PER_TOKEN"]
    kernels = {n: formats.get(n).kernel for n in formats.names()}
    assert kernels == {"bf16": "dense", "FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8", "W8A8_SQ_PER_CHANNEL": "int8",
                       "W4A16_AWQ": "int4", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4",
                       "W4A16_ZP": "int4", "INT8_PER_CHANNEL_PER_TOKEN": "int8"}
    assert {f.name for f in formats.calibrated()} == {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_AWQ",
                                                      "W8A8_SQ_PER_CHANNEL"}
