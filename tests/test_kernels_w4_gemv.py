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
