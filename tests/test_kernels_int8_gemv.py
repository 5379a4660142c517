"""INT8 W8A8 at small M by dp4a (lowbit.kernels.linear.int8_gemv) on CPU under the Triton interpreter, against the torch
reference scaled_gemm_ref: x rows 1-8, per-tensor and per-row weight scales, per-tensor and per-token x scales,
bias, K ragged (masked words), N not a multiple of BLOCK_N, the extreme int8 values (sign extension). The
interpreter emulates dp4a with shifts (the GPU runs inline PTX; dev/bench/int8_gemv_bench.py checks that path against
the same reference)."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear import int8_gemv  # noqa: E402
from lowbit.kernels.linear.scaled_gemm import scaled_gemm_ref  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
# int32 sums are exact; the reference sums in fp32 (exact below 2^24) and both scale in fp32: ~1e-7
TOL = 1e-6


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("m,k,n,config,sa_rows,sb_rows,bias", [
    (1, 2048, 16, (8, 512, 1), False, True, False),  # four steps, per-row weight scales (SmoothQuant's)
    (3, 1040, 18, (8, 512, 1), True, True, True),  # ragged K (65 chunks in steps of 32), N past the tile, per-token
    (8, 4096, 8, (4, 1024, 2), False, False, True),  # MAX_M rows, 2 warps
    (6, 2048, 24, (8, 1024, 2), True, True, False),  # rows 6, 7 of an 8-row program masked
    (5, 100, 9, None, False, True, False),  # the default config, K under one chunk per thread
])
def test_int8_gemv_matches_reference(m, k, n, config, sa_rows, sb_rows, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    sa = torch.rand(m, 1, generator=g) + 0.5 if sa_rows else torch.tensor(0.3)
    sb = torch.rand(n, generator=g) + 0.5 if sb_rows else torch.tensor(0.7)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    out = int8_gemv.int8_gemv(q, w, sa, sb, b, torch.float32, config)
    ref = scaled_gemm_ref(q, w, sa, sb, b, torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    for row in range(m):
        assert rel_err(out[row], ref[row]) < TOL, row
    assert rel_err(int8_gemv.int8_gemv(q, w, sa, sb, b, torch.bfloat16, config), ref) < 1e-2  # one bf16 rounding


def test_extreme_values_sign_extended():
    """-128 and 127 in every byte position: exact int32 sums (a byte taken unsigned would be off by 256 x)."""
    k = 512
    q = torch.tensor([[-128, 127, -1, 1] * (k // 4), [127, -128, 1, -1] * (k // 4)], dtype=torch.int8)
    w = torch.tensor([[-128] * k, [127] * k, [-128, -128, 127, 127] * (k // 4)], dtype=torch.int8)
    out = int8_gemv.int8_gemv(q, w, torch.tensor(1.0), torch.tensor(1.0), None, torch.float32, (8, 512, 1))
    assert torch.equal(out, q.float() @ w.float().t())


def test_supports():
    q, w, one = torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 64, dtype=torch.int8), torch.tensor(1.0)
    assert int8_gemv.supports(q, w, one) and int8_gemv.supports(q, w, torch.ones(8, 1))
    assert not int8_gemv.supports(torch.zeros(9, 64, dtype=torch.int8), w, one)
    assert not int8_gemv.supports(torch.zeros(2, 62, dtype=torch.int8), torch.zeros(8, 62, dtype=torch.int8), one)
    assert not int8_gemv.supports(q.view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn), one)
