"""Decode GEMV for 4-bit weights (lowbit.kernels.w4_gemv) on CPU under the Triton interpreter, against the torch
reference w4a16_gemm_ref: INT4 groups 32/64/128/256 and NVFP4, with pre_quant_scale and bias, K not a multiple of
128 (padded), N not a multiple of BLOCK_N, M = 1..8. fp16 inputs (the interpreter truncates fp32 -> bf16 casts,
which costs ~4e-3 relative error that the GPU, rounding to nearest, does not have)."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels import w4_gemv, w4a16  # noqa: E402
from lowbit.kernels.synthetic import quantize_linear  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
TOL = 1e-3  # measured: <= 2e-5 (fp32 sums in another order than the reference, fp16 output)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _packed(fmt, n, k, group, smooth, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if fmt == "int4":
        t = quantize_linear("W4A16_AWQ", w, group=group, smooth=smooth)
        return w4a16.pack_int4(t["weight"], t["weight_scale"], smooth)
    t = quantize_linear("W4A16_NVFP4", w)
    return w4a16.pack_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], smooth)


@pytest.mark.parametrize("fmt,k,n,group,m,config", [
    ("int4", 256, 64, 128, 1, None),
    ("int4", 384, 96, 32, 3, (4, 256, 2, False)),
    ("int4", 256, 96, 64, 8, (8, 128, 1, True)),
    ("int4", 320, 80, 64, 2, (4, 128, 1, False)),  # K padded to 384
    ("int4", 512, 64, 256, 5, (2, 512, 2, True)),
    ("nvfp4", 256, 64, 16, 1, None),
    ("nvfp4", 208, 96, 16, 3, (4, 128, 1, True)),  # K padded to 256
    ("nvfp4", 384, 72, 16, 8, (8, 256, 2, False)),
])
def test_gemv_matches_reference(fmt, k, n, group, m, config):
    g = torch.Generator().manual_seed(m + k)
    smooth = (0.5 + torch.rand(k, generator=g)).half()
    packed = _packed(fmt, n, k, group, smooth, seed=k + n)
    x = torch.randn(m, k, generator=g).half()
    bias = torch.randn(n, generator=g).half()
    out = w4_gemv.w4_gemv(x, packed, bias, config)
    ref = w4a16.w4a16_gemm_ref(x, packed, bias)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert rel_err(out, ref) < TOL


def test_gemv_without_smooth_and_bias_bf16():
    packed = _packed("int4", 64, 256, 64, None, seed=1)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = w4_gemv.w4_gemv(x, packed)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < 1e-2  # bf16: interpreter truncation, see module doc


def test_w4a16_gemm_dispatches_decode_to_the_gemv(monkeypatch):
    packed = _packed("nvfp4", 64, 256, 16, None, seed=3)
    calls = []
    real = w4_gemv.w4_gemv
    monkeypatch.setattr(w4_gemv, "w4_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 2):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half()
        out = w4a16.w4a16_gemm(x, packed)
        assert rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < 2e-3
    assert calls == [m for m in (1, 2) if m <= w4_gemv.GEMV_MAX_M]


# ---- the wide kernel (M = 1): pure-Triton path here (the GPU runs inline PTX for NVFP4's fp16 -> fp32; the GPU
# bench bench/w4_gemv_bench.py checks that path against the same reference)
@pytest.mark.parametrize("fmt,k,n,group,config,smooth,bias", [
    ("int4", 2048, 64, 128, ("wide", 8, 2048, 2, False), False, False),  # one even step
    ("int4", 4096 + 640, 34, 64, ("wide", 8, 4096, 4, False), True, True),  # 2 steps, the last one masked
    ("int4", 3088, 18, 16, ("wide", 4, 1024, 1, False), True, True),  # groups of 16: two scales per chunk
    ("int4", 992, 6, 32, ("wide", 4, 2048, 1, False), False, True),  # 2 chunks per thread, K < BLOCK_K
    ("int4", 2304, 20, 256, ("wide", 4, 1024, 1, True), True, False),  # prefetch, groups of 256
    ("int4", 1024, 48, 128, ("wide", 16, 1024, 1, False), False, False),
    ("nvfp4", 2048, 33, 16, ("wide", 8, 1024, 1, False), False, True),  # odd N
    ("nvfp4", 2000, 19, 16, ("wide", 4, 2048, 2, True), True, True),  # K padded to 2048, prefetch
    ("nvfp4", 3072, 24, 16, ("wide", 16, 1024, 1, False), True, False),
])
def test_wide_gemv_matches_reference(fmt, k, n, group, config, smooth, bias):
    g = torch.Generator().manual_seed(k + n)
    sm = (0.5 + torch.rand(k, generator=g)).half() if smooth else None
    packed = _packed(fmt, n, k, group, sm, seed=k)
    x = torch.randn(1, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    out = w4_gemv.w4_gemv(x, packed, b, config)
    ref = w4a16.w4a16_gemm_ref(x, packed, b)
    assert out.shape == (1, n) and out.dtype == torch.float16
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 16), ("nvfp4", 16)])
def test_gemv_accumulates_in_fp32(fmt, group):
    """fp32 x and output: the kernels' own arithmetic against an fp64 reference (torch's fp32 matmul: ~6e-7).
    The wide INT4 chains carry the 256 x / 16 x that the nibble decoding adds (removed once per chunk, exactly
    in exact arithmetic), so their fp32 rounding is ~2^-24 x 1000 |x| per FMA: measured 4e-6..1e-5 relative (v1
    7e-7); bf16 output rounding is ~1e-3. NVFP4 values and products are exact in fp32 (both ~1.5e-7)."""
    k, n = 4096, 16
    packed = _packed(fmt, n, k, group, None, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ w4a16.dequantize_w4(packed).double().t()
    for config, tol in ((("wide", 8, 2048, 2, False), 3e-5 if fmt == "int4" else 1e-6), ((4, 2048, 4, False), 2e-6)):
        out = w4_gemv.w4_gemv(x, packed, None, config)
        assert out.dtype == torch.float32
        assert rel_err(out.double(), ref) < tol, config


def test_wide_gemv_dispatch(monkeypatch):
    """GEMV_VARIANT = "wide" routes w4a16_gemm's M = 1 to the wide kernel; M > 1 never takes it."""
    packed = _packed("int4", 64, 2048, 128, None, seed=7)
    assert w4_gemv.choose_gemv_config(1, 64, 2048, "int4", "wide")[0] == "wide"
    assert w4_gemv.choose_gemv_config(2, 64, 2048, "int4", "wide") == w4_gemv.choose_gemv_config(2, 64, 2048, "int4")
    monkeypatch.setattr(w4_gemv, "GEMV_VARIANT", "wide")
    calls = []
    real = w4_gemv._w4_gemv_wide
    monkeypatch.setattr(w4_gemv, "_w4_gemv_wide", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(8)).half()
    out = w4a16.w4a16_gemm(x, packed)
    assert calls == [1] and rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < TOL
    with pytest.raises(AssertionError):
        w4_gemv.w4_gemv(torch.randn(2, 2048).half(), packed, None, ("wide", 8, 2048, 2, False))
