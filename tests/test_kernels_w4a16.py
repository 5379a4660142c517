"""4-bit weight-only GEMM: packing round trip and the Triton kernel (CPU interpreter, fp16: the interpreter's bf16
tl.dot is wrong) against the torch reference, for INT4 (modelopt AWQ) and NVFP4 weights."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.formats import dequantize_weight  # noqa: E402
from lowbit.kernels.linear import w4_small_m, w4a16  # noqa: E402
from lowbit.testing.synthetic import quantize_linear  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _packed(fmt, n, k, group=128, smooth=None, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    algo = "W4A16_AWQ" if fmt == "int4" else "W4A16_NVFP4"
    t = quantize_linear(algo, w, group=group, smooth=smooth)
    if fmt == "int4":
        return t, w4a16.pack_int4(t["weight"], t["weight_scale"], smooth)
    return t, w4a16.pack_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])


@pytest.mark.parametrize("fmt,k,group", [("int4", 256, 128), ("int4", 192, 64), ("int4", 160, 32),
                                         ("nvfp4", 256, 16), ("nvfp4", 208, 16)])
def test_pack_round_trip_equals_checkpoint_dequantization(fmt, k, group):
    t, packed = _packed(fmt, 48, k, group)
    algo = "W4A16_AWQ" if fmt == "int4" else "W4A16_NVFP4"
    assert packed.qweight.shape == (48, -(-k // 128) * 16)
    assert torch.equal(w4a16.dequantize_w4(packed), dequantize_weight(algo, t))


@pytest.mark.parametrize("fmt,m,k,group,split", [("int4", 3, 256, 128, 1), ("int4", 17, 320, 64, 2),
                                                 ("int4", 5, 512, 256, 1), ("nvfp4", 2, 256, 16, 1),
                                                 ("nvfp4", 9, 208, 16, 2)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_kernel_matches_reference(fmt, m, k, group, split, prefetch, monkeypatch):
    """The tensor-core kernel (weights dequantized from bytes: _byte_nibbles) against the fp32 reference: groups of
    32 to 256, ragged K, pre_quant_scale (INT4), bias, K splits (odd tile counts per split), partial M and N tiles;
    the scales loaded one tile ahead or not."""
    monkeypatch.setattr(tuning, "_OVERRIDE", [dataclasses.replace(tuning.current(), w4_prefetch_scales=prefetch)])
    n = 80  # not a multiple of BLOCK_N: the last block is partial
    g = torch.Generator().manual_seed(m)
    smooth = (0.5 + torch.rand(k, generator=g)).half() if fmt == "int4" else None
    _, packed = _packed(fmt, n, k, group, smooth, seed=k)
    x = torch.randn(m, k, generator=g).half()
    bias = torch.randn(n, generator=g).half()
    out = w4a16.w4a16_gemm(x, packed, bias, config=(16, 32, split, 4, 1))
    ref = w4a16.w4a16_gemm_ref(x, packed, bias)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert rel_err(out, ref) < 2e-3


def test_unsupported_group_is_refused_by_the_packer():
    assert not w4a16.int4_group_supported(48) and not w4a16.int4_group_supported(8)
    assert w4a16.int4_group_supported(128) and w4a16.int4_group_supported(256)
    w = torch.randn(8, 96) * 0.02
    t = quantize_linear("W4A16_AWQ", w, group=48)
    with pytest.raises(ValueError, match="group size 48"):
        w4a16.pack_int4(t["weight"], t["weight_scale"])


@pytest.mark.parametrize("fmt,m,k,group,split", [("int4", 3, 256, 128, 1), ("int4", 16, 320, 64, 2),
                                                 ("int4", 5, 512, 256, 2), ("int4", 2, 160, 32, 1),
                                                 ("int4", 7, 256, 16, 1), ("nvfp4", 2, 256, 16, 1),
                                                 ("nvfp4", 9, 208, 16, 2)])
def test_small_m_kernel_matches_reference(fmt, m, k, group, split):
    """w4_small_m (nibble planes, x copied into plane order) against the fp32 reference: groups of 16 to 256,
    ragged K (padded to 128), pre_quant_scale, bias, K splits, a partial last N block."""
    n = 80
    g = torch.Generator().manual_seed(m)
    smooth = (0.5 + torch.rand(k, generator=g)).half() if fmt == "int4" else None
    _, packed = _packed(fmt, n, k, group, smooth, seed=k)
    x = torch.randn(m, k, generator=g).half()
    bias = torch.randn(n, generator=g).half()
    ref = w4a16.w4a16_gemm_ref(x, packed, bias)
    for config in ((32, split, 4, 1), (32, split, 4, 1, 32)):  # BLOCK_M 16 and 32 (rows past M masked)
        out = w4_small_m.w4_small_m(x, packed, bias, config=config)
        assert out.shape == (m, n) and out.dtype == torch.float16
        assert rel_err(out, ref) < 2e-3


def test_x_planes_order():
    """Element 16s + j of each 128-tile of x_planes is x[128t + 8j + s]."""
    _, packed = _packed("int4", 8, 160, group=32)  # K = 160 -> KP = 256: zero padding past K
    x = torch.randn(3, 160).half()
    planes = w4_small_m.x_planes(x, packed).view(3, 2, 8, 16)
    t, s, j = 1, 5, 3
    assert planes[2, t, s, j] == x[2, 128 * t + 8 * j + s]
    back = planes.transpose(2, 3).reshape(3, 256)  # natural order again
    assert back[:, :160].equal(x) and back[:, 160:].abs().sum() == 0


def test_small_m_dispatch(monkeypatch):
    """w4a16_gemm hands 2 <= M <= 16 of large INT4 layers that w4_mma does not take to w4_small_m (where the H200
    measured it faster)."""
    assert w4_small_m.takes(2, 28672, 4096, "int4") and w4_small_m.takes(16, 4096, 14336, "int4")
    assert not w4_small_m.takes(1, 28672, 4096, "int4") and not w4_small_m.takes(17, 28672, 4096, "int4")
    assert not w4_small_m.takes(16, 6144, 4096, "int4")  # qkv-sized: the tensor-core kernel was as fast
    assert not w4_small_m.takes(16, 28672, 4096, "nvfp4")
    calls = []  # the dispatch itself, on layers small enough for the interpreter
    monkeypatch.setattr(tuning, "_OVERRIDE", [dataclasses.replace(tuning.current(), w4_small_m_min_weights=48 * 256)])
    monkeypatch.setattr(w4_small_m, "w4_small_m", lambda x, w, bias=None: calls.append(w.fmt) or "small_m")
    for fmt, group in (("int4", 128), ("nvfp4", 16)):
        _, packed = _packed(fmt, 48, 256, group)
        for m in (1, 12, 17):  # M = 2-8 of INT4 runs w4_mma first (Tuning.w4_mma_rows)
            out = w4a16.w4a16_gemm(torch.randn(m, 256).half(), packed)
            assert (out == "small_m") == (fmt == "int4" and m == 12)
    assert calls == ["int4"]
