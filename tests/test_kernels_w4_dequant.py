"""The large-M weight-only 4-bit path (lowbit.kernels.linear.w4_dequant: dequantize into a 16-bit scratch, then one GEMM)
on CPU under the Triton interpreter, against the torch references: the dequantized weight against dequantize_w4
(INT4 groups 16-512, a group straddling tiles, NVFP4; K padded, N not a multiple of the tile), and w4a16_gemm at
M >= Tuning.w4_dequant_min_m against w4a16_gemm_ref (pre_quant_scale and bias). fp16 throughout: the interpreter truncates
fp32 -> bf16 casts."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear import w4_dequant, w4a16  # noqa: E402
from lowbit.testing.synthetic import random_w4_weight  # noqa: E402

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
    m, k, n = tuning.current().w4_dequant_min_m[fmt], 384, 24
    g = torch.Generator().manual_seed(7)
    sm = (0.5 + torch.rand(k, generator=g)).half() if smooth else None
    packed = random_w4_weight(fmt, n, k, 128, sm, seed=3)
    x = torch.randn(m, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    monkeypatch.setattr(w4a16, "tensor_core_gemm", None)  # M >= w4_dequant_min_m must not reach the other kernels
    out = w4a16.w4a16_gemm(x, packed, b)
    ref = w4a16.w4a16_gemm_ref(x, packed, b)
    assert out.shape == (m, n) and out.dtype == torch.float16
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < GEMM_TOL, err


@pytest.mark.parametrize("fmt,m,dequant", [("int4", 256, False), ("int4", 257, True), ("nvfp4", 128, False),
                                           ("nvfp4", 129, True)])
def test_dequant_rows_per_format(fmt, m, dequant, monkeypatch):
    """w4a16_gemm takes the dequant path from Tuning.w4_dequant_min_m[fmt] rows (INT4 257, NVFP4 129: where the H200 measured
    it faster than the tensor-core kernel) and the tensor-core kernel below; both still match the reference."""
    calls = []
    for name, mod in (("dequant_linear", w4_dequant), ("tensor_core_gemm", w4a16)):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    packed = random_w4_weight(fmt, 24, 256, 128 if fmt == "int4" else 16, None, seed=5)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(5)).half()
    out = w4a16.w4a16_gemm(x, packed)
    assert calls == ["dequant_linear" if dequant else "tensor_core_gemm"]
    ref = w4a16.w4a16_gemm_ref(x, packed).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < GEMM_TOL, err


def test_tuned_configs_cover_llama_shapes():
    """Every Llama-3.1-8B linear shape has a tuned tile per format and M bucket, BLOCK_M the bucket's (128 from 128
    rows), and choose_config returns it for rows inside the bucket."""
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    for fmt in ("int4", "nvfp4"):
        for kp, n in shapes:
            for m, block_m in ((17, 32), (32, 32), (33, 64), (64, 64), (65, 128), (128, 128), (129, 128), (512, 128)):
                cfg = w4a16.choose_config(m, n, kp, fmt)
                tuned = tuning.current().w4_gemm_tuned[(fmt, kp, n, w4a16.m_bucket(m))]
                assert cfg == tuned and cfg[0] == block_m, (fmt, n, m, cfg)
