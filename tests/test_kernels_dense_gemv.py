"""Decode GEMV for plain bf16 / fp16 weights (lowbit.kernels.linear.dense_gemv, M = 1) on CPU under the Triton interpreter,
against fp32 math rounded to the output dtype: one and several K steps, K ragged (masked last step), N odd / not a
multiple of BLOCK_N, bias, several chunks per thread. The GPU side: dev/bench/dense_gemv_bench.py (same reference)."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear.dense_gemv import dense_gemv  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}  # the interpreter truncates fp32 -> bf16 (~4e-3), fp16 rounds


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("k,n,config,dtype,bias", [
    (256, 8, (8, 256, 1), torch.bfloat16, False),  # one even step
    (1024, 12, (8, 256, 1), torch.float16, True),  # four steps; N not a multiple of BLOCK_N
    (300, 5, (4, 256, 1), torch.float16, True),  # K ragged: the second step masked
    (700, 33, (4, 512, 1), torch.float16, False),  # two chunks per thread, K < 2 steps
    (1000, 9, (8, 512, 2), torch.bfloat16, True),  # two warps
])
def test_dense_gemv_matches_fp32_math(k, n, config, dtype, bias):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = (x.float() @ w.float().T + (b.float() if bias else 0)).to(dtype)
    out = dense_gemv(x, w, b, config)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_dense_gemv_rejects_a_config_that_does_not_cover_the_threads():
    x = torch.randn(1, 256)
    with pytest.raises(AssertionError):
        dense_gemv(x.bfloat16(), torch.randn(4, 256).bfloat16(), None, (4, 128, 1))


@pytest.mark.parametrize("k,n,config,row_scales,bias", [
    (512, 8, (8, 512, 1), False, False),  # one even step, per-tensor weight scale
    (1200, 13, (4, 512, 1), True, True),  # three steps, the last masked; per-row weight scales; N odd
    (2048, 6, (4, 1024, 2), True, False),  # two warps, two chunks per thread
])
def test_fp8_gemv_matches_scaled_gemm_ref(k, n, config, row_scales, bias):
    """FP8 codes times FP8 codes are exact in fp32: only the order of the fp32 sums differs from the reference."""
    from lowbit.kernels.linear.dense_gemv import fp8_gemv
    from lowbit.kernels.linear.scaled_gemm import scaled_gemm_ref

    g = torch.Generator().manual_seed(k + n)
    q = (torch.randn(1, k, generator=g) * 20).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 20).to(torch.float8_e4m3fn)
    sa = torch.tensor(0.01)
    sb = torch.rand(n, generator=g) * 1e-3 + 1e-4 if row_scales else torch.tensor(3e-4)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    ref = scaled_gemm_ref(q, w, sa, sb, b, torch.float32)
    out = fp8_gemv(q, w, sa, sb, b, torch.float32, config)
    assert out.shape == (1, n) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("k,d,config", [(1024, 12, (8, 256, 1)), (300, 5, (4, 256, 1)), (1000, 9, (8, 512, 2))])
def test_dense_gemv_silu_mul_matches_silu_and_mul(k, d, config):
    """silu_mul: each program pairs BLOCK_N / 2 gate rows with their up rows (D odd, not a multiple of BLOCK_N / 2)."""
    from lowbit.kernels.ops.activation import silu_and_mul_ref
    from lowbit.kernels.linear.dense_gemv import dense_gemv_ref

    g = torch.Generator().manual_seed(k + d)
    x = torch.randn(1, k, generator=g).to(torch.float16)
    w = (torch.randn(2 * d, k, generator=g) * 0.05).to(torch.float16)
    want = silu_and_mul_ref(dense_gemv_ref(x, w))
    assert torch.equal(dense_gemv_ref(x, w, silu_mul=True), want)
    out = dense_gemv(x, w, None, config, silu_mul=True)
    assert out.shape == (1, d) and rel_err(out, want) < TOL[torch.float16]
