"""Decode GEMV for 4-bit weights (lowbit.kernels.linear.w4_gemv, M = 1) on CPU under the Triton interpreter, against the
torch reference w4a16_gemm_ref: INT4 groups 16/32/64/128/256 and NVFP4, pre_quant_scale and bias, K ragged (not a
multiple of BLOCK_K: masked x and chunks) and padded (not a multiple of 128), N odd / not a multiple of BLOCK_N,
several chunks per thread. The interpreter runs the pure-Triton fp16 -> fp32 conversion (the GPU runs inline PTX;
dev/bench/w4_gemv_bench.py checks that path against the same reference). fp16 inputs: the interpreter truncates
fp32 -> bf16 casts (~4e-3 relative error that the GPU, rounding to nearest, does not have)."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear import w4_gemv, w4a16  # noqa: E402
from lowbit.testing.synthetic import random_w4_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
TOL = 1e-3  # fp16 output vs the reference (fp32 sums in another order, both rounded to fp16): measured <= 2e-5


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("fmt,k,n,group,config,smooth,bias", [
    ("int4", 2048, 64, 128, None, False, False),  # the default tile: one even step
    ("int4", 4096 + 640, 34, 64, None, True, True),  # 3 steps, the last one masked (ragged K)
    ("int4", 3088, 18, 16, (4, 1024, 1), True, True),  # groups of 16: two scales per chunk; K padded to 3200
    ("int4", 992, 6, 32, (4, 2048, 1), False, True),  # 2 chunks per thread, K < BLOCK_K
    ("int4", 2304, 20, 256, (4, 1024, 1), True, False),  # groups of 256
    ("int4", 1024, 48, 128, (16, 1024, 1), False, False),
    ("nvfp4", 2048, 33, 16, None, False, True),  # odd N
    ("nvfp4", 2000, 19, 16, (4, 2048, 2), True, True),  # K padded to 2048
    ("nvfp4", 4096 + 208, 24, 16, None, True, False),  # ragged and padded K, 3 steps
])
def test_gemv_matches_reference(fmt, k, n, group, config, smooth, bias):
    g = torch.Generator().manual_seed(k + n)
    sm = (0.5 + torch.rand(k, generator=g)).half() if smooth else None
    packed = random_w4_weight(fmt, n, k, group, sm, seed=k)
    x = torch.randn(1, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    out = w4_gemv.w4_gemv(x, packed, b, config)
    ref = w4a16.w4a16_gemm_ref(x, packed, b)
    assert out.shape == (1, n) and out.dtype == torch.float16
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("fmt,k,n,group,config,smooth,bias", [
    ("int4", 2048, 64, 128, None, False, False),  # GEMV_CONFIG_M2: one even step
    ("int4", 4096 + 640, 34, 64, None, True, True),  # 3 steps, the last one masked; N odd
    ("int4", 3088, 18, 16, (4, 1024, 1), True, True),  # groups of 16: two scales per chunk
    ("nvfp4", 2000, 19, 16, (8, 2048, 2), True, True),  # K padded to 2048
    ("nvfp4", 4096 + 208, 24, 16, None, False, False),
])
def test_gemv_two_rows_match_reference(fmt, k, n, group, config, smooth, bias):
    """M = 2: both rows from the same dequantized weights, each against the reference (a second row that reused
    the first row's x, offsets or scales, or was stored over it, fails here)."""
    g = torch.Generator().manual_seed(k + n + 1)
    sm = (0.5 + torch.rand(k, generator=g)).half() if smooth else None
    packed = random_w4_weight(fmt, n, k, group, sm, seed=k + 1)
    x = torch.randn(2, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    out = w4_gemv.w4_gemv(x, packed, b, config)
    ref = w4a16.w4a16_gemm_ref(x, packed, b)
    assert out.shape == (2, n) and out.dtype == torch.float16
    for m in range(2):
        assert rel_err(out[m], ref[m]) < TOL, m


def test_gemv_bf16():
    packed = random_w4_weight("int4", 64, 2048, 64, None, seed=1)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = w4_gemv.w4_gemv(x, packed)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < 1e-2  # bf16: interpreter truncation, see module doc


@pytest.mark.parametrize("fmt,group,tol", [("int4", 128, 3e-5), ("int4", 16, 3e-5), ("nvfp4", 16, 1e-6)])
def test_gemv_accumulates_in_fp32(fmt, group, tol):
    """fp32 x and output: the kernel's own arithmetic against an fp64 reference (torch's fp32 matmul: ~6e-7).
    The INT4 chains carry the 256 x / 16 x that the nibble decoding adds (removed once per chunk, exactly in exact
    arithmetic), so their fp32 rounding is ~2^-24 x 1000 |x| per FMA: measured 4e-6..1e-5 relative; bf16 output
    rounding is ~1e-3. NVFP4 values and products are exact in fp32 (~1.5e-7)."""
    k, n = 4096, 16
    packed = random_w4_weight(fmt, n, k, group, None, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ w4a16.dequantize_w4(packed).double().t()
    out = w4_gemv.w4_gemv(x, packed)
    assert out.dtype == torch.float32
    assert rel_err(out.double(), ref) < tol


def test_w4a16_gemm_dispatches_decode_to_the_gemv(monkeypatch):
    """w4a16_gemm runs M <= Tuning.w4_gemv_max_m (= 2) on the GEMV, M = 3 on the tensor-core kernel (w4_mma, whose
    w4_mma_rows come first, switched off here; tests/test_kernels_w4_mma.py checks that order)."""
    monkeypatch.setattr(tuning, "_OVERRIDE", [dataclasses.replace(tuning.current(), w4_mma_rows={})])
    packed = random_w4_weight("nvfp4", 64, 2048, 16, None, seed=3)
    calls = []
    real = w4_gemv.w4_gemv
    monkeypatch.setattr(w4_gemv, "w4_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 2, 3):
        x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).half()
        out = w4a16.w4a16_gemm(x, packed)
        assert rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < 2e-3
    assert tuning.for_capability((9, 0)).w4_gemv_max_m == 2 and calls == [1, 2]


def test_gemv_rejects_bad_shapes():
    packed = random_w4_weight("int4", 16, 2048, 128, None, seed=7)
    with pytest.raises(AssertionError):  # M = 1 or 2 only
        w4_gemv.w4_gemv(torch.randn(3, 2048).half(), packed)
    with pytest.raises(AssertionError):  # BLOCK_K must cover 32 chunks per warp
        w4_gemv.w4_gemv(torch.randn(1, 2048).half(), packed, None, (8, 1024, 2))
