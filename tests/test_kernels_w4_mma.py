"""4-bit weights on mma.sync for 1 <= M <= 16 x rows (lowbit.kernels.linear.w4_mma) on CPU under the Triton interpreter,
against the torch reference w4a16_gemm_ref: x row counts up to 16 (each lane holds two x rows of each mma's D; rows
9-16 are a second B tile), INT4 groups 128 and 256 and NVFP4 (block scales in the A registers), bf16 and fp16 x,
pre_quant_scale and bias, K ragged (not a multiple of BLOCK_K: masked x) and padded, N not a multiple of the 16-row
tile, split-K over warps. The interpreter emulates the dequantization and the warp's mma (the GPU runs inline PTX;
dev/bench/w4_mma_bench.py checks that path against the same reference)."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear import w4_mma, w4a16  # noqa: E402
from lowbit.testing.synthetic import random_w4_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
# exact q x products, fp32 sums, one rounding of the output to x's dtype: fp16 measured ~3e-4; the interpreter
# truncates fp32 -> bf16 casts (the GPU rounds to nearest): ~4e-3, up to 9e-3 on a 16-value row with x * smooth
# truncated too. A row or column mapped wrongly gives errors of order 1.
TOL = {torch.float16: 1e-3, torch.bfloat16: 1.5e-2}


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("fmt,m,k,n,group,dtype,config,smooth,bias", [
    ("int4", 8, 1024, 32, 128, torch.bfloat16, (16, 512, 2), False, False),  # two steps, U = 2 blocks per warp
    ("int4", 3, 1024, 32, 128, torch.bfloat16, (16, 256, 2), True, True),  # odd M: rows 3..7 of B are zeros
    ("int4", 1, 768, 18, 128, torch.float16, (16, 256, 1), False, True),  # N past the tile, fp16 (the f16 mma's magic)
    ("int4", 5, 896, 16, 128, torch.bfloat16, (32, 512, 2), True, False),  # K ragged (7 blocks in steps of 4): masked x
    ("int4", 8, 1024, 48, 256, torch.float16, (16, 512, 1), False, False),  # groups of 256
    ("int4", 2, 512, 16, 128, torch.bfloat16, None, False, True),  # Tuning.w4_mma_config: one masked step
    ("int4", 16, 1024, 32, 128, torch.float16, (16, 512, 2), False, True),  # two x tiles, all rows
    ("int4", 11, 896, 16, 128, torch.bfloat16, (32, 512, 2), True, False),  # two x tiles, rows 11-15 of the second zero
    ("nvfp4", 8, 1024, 32, 16, torch.bfloat16, (16, 512, 2), False, True),  # block scales in A, f16 mmas
    ("nvfp4", 3, 896, 16, 16, torch.float16, (32, 512, 2), True, False),  # ragged K, smooth
    ("nvfp4", 16, 512, 16, 16, torch.bfloat16, (16, 256, 1), False, False),  # two x tiles
    ("nvfp4", 5, 400, 18, 16, torch.float16, (16, 256, 1), False, True),  # K padded to 512 (zero codes past K)
])
def test_w4_mma_matches_reference(fmt, m, k, n, group, dtype, config, smooth, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    sm = (0.5 + torch.rand(k, generator=g)).to(dtype) if smooth else None
    packed = random_w4_weight(fmt, n, k, group, sm, seed=k + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = w4_mma.w4_mma(x, packed, b, config)
    ref = w4a16.w4a16_gemm_ref(x, packed, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    for row in range(m):  # every x row on its own (each lane stores two of them)
        assert rel_err(out[row], ref[row]) < TOL[dtype], row


def test_supports():
    int4 = random_w4_weight("int4", 16, 256, 128)
    assert w4_mma.supports(16, int4) and not w4_mma.supports(17, int4) and not w4_mma.supports(0, int4)
    assert not w4_mma.supports(4, random_w4_weight("int4", 16, 256, 64))  # groups under 128
    assert w4_mma.supports(4, random_w4_weight("nvfp4", 16, 256, 16))


def test_w4a16_gemm_routes_mma_rows(monkeypatch):
    """With w4_mma_rows covering M, w4a16_gemm runs w4_mma (no other kernel), and still matches the reference."""
    monkeypatch.setattr(tuning, "_OVERRIDE", [dataclasses.replace(tuning.current(), w4_mma_rows={"int4": (1, 8)})])
    monkeypatch.setattr(w4a16.w4_gemv, "w4_gemv", None)
    monkeypatch.setattr(w4a16, "tensor_core_gemm", None)
    packed = random_w4_weight("int4", 16, 512, 128, None, seed=2)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)).half()
    out = w4a16.w4a16_gemm(x, packed)
    assert rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < TOL[torch.float16]


@pytest.mark.parametrize("fmt,group,m,takes_mma", [
    ("int4", 128, 1, False), ("int4", 128, 2, True), ("int4", 128, 8, True), ("int4", 128, 9, False),
    ("int4", 64, 4, False), ("nvfp4", 16, 1, False), ("nvfp4", 16, 2, True), ("nvfp4", 16, 8, True),
    ("nvfp4", 16, 9, False), ("nvfp4", 16, 16, False),
])
def test_default_mma_rows(monkeypatch, fmt, group, m, takes_mma):
    """The default w4_mma_rows: INT4 (groups of 128 or more) and NVFP4 at M = 2-8; M = 1 stays on the GEMV, 9-16 go to
    the tensor-core kernel (or w4_small_m)."""
    calls = []
    ref = w4a16.w4a16_gemm_ref
    monkeypatch.setattr(w4_mma, "w4_mma", lambda x, w, bias=None: calls.append(x.shape[0]) or ref(x, w, bias))
    packed = random_w4_weight(fmt, 16, 256, group, None, seed=3)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(3)).half()  # interpreted bf16 tl.dot: garbage
    out = w4a16.w4a16_gemm(x, packed)
    assert calls == ([m] if takes_mma else [])
    assert rel_err(out, w4a16.w4a16_gemm_ref(x, packed)) < TOL[torch.float16]


def test_choose_config():
    """Rows 9-16 of wide layers take Tuning.w4_mma_wide_config; everything else w4_mma_config."""
    t = tuning.current()
    assert w4_mma.choose_config(16, 28672) == t.w4_mma_wide_config
    assert w4_mma.choose_config(8, 28672) == t.w4_mma_config
    assert w4_mma.choose_config(16, 6144) == t.w4_mma_config
