"""The large-M weight-only 4-bit path (lowbit.kernels.w4_dequant: dequantize into a 16-bit scratch, then one GEMM)
on CPU under the Triton interpreter, against the torch references: the dequantized weight against dequantize_w4
(INT4 groups 16-512, a group straddling tiles, NVFP4; K padded, N not a multiple of the tile), and w4a16_gemm at
M >= DEQUANT_MIN_M against w4a16_gemm_ref (pre_quant_scale and bias). fp16 throughout: the interpreter truncates
fp32 -> bf16 casts."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels import w4_dequant, w4a16  # noqa: E402
from lowbit.kernels.synthetic import random_w4_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
W_TOL = 2 ** -11  # each weight rounded once to fp16 (relative half-ulp 2^-11)
GEMM_TOL = 2e-3  # fp16 GEMM on fp16-rounded weights vs the fp32 reference, both rounded to fp16


@pytest.mark.parametrize("fmt,k,n,group", [
    ("int4", 512, 64, 128),
    ("int4", 1008, 40, 16),  # K padded to 1024; N not a multiple of BLOCK_N
    ("int4", 768, 34, 64),
    ("int4", 1024, 8, 512),  # groups wider than the tile
    ("int4", 1152, 8, 384),  # groups straddling tiles
    ("nvfp4", 512, 64, 16),
    ("nvfp4", 400, 35, 16),  # K padded to 512
])
def test_dequantized_weight_matches_reference(fmt, k, n, group):
    packed = random_w4_weight(fmt, n, k, group, None, seed=k + n)
    out = torch.full((n, k), float("nan"), dtype=torch.float16)
    w4_dequant.dequantize_into(packed, out)
    ref = w4a16.dequantize_w4(packed)[:, :k]
    assert torch.allclose(out.float(), ref, rtol=W_TOL, atol=0), (out.float() - ref).abs().max()


@pytest.mark.parametrize("fmt,smooth,bias", [("int4", True, True), ("nvfp4", False, True), ("int4", False, False)])
def test_large_m_gemm_matches_reference(fmt, smooth, bias, monkeypatch):
    m, k, n = w4a16.DEQUANT_MIN_M[fmt], 384, 24
    g = torch.Generator().manual_seed(7)
    sm = (0.5 + torch.rand(k, generator=g)).half() if smooth else None
    packed = random_w4_weight(fmt, n, k, 128, sm, seed=3)
    x = torch.randn(m, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    monkeypatch.setattr(w4a16, "tensor_core_gemm", None)  # M >= DEQUANT_MIN_M must not reach the other kernels
    out = w4a16.w4a16_gemm(x, packed, b)
    ref = w4a16.w4a16_gemm_ref(x, packed, b)
    assert out.shape == (m, n) and out.dtype == torch.float16
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < GEMM_TOL, err
