"""4-bit weight-only GEMM: packing round trip and the Triton kernel (CPU interpreter, fp16: the interpreter's bf16
tl.dot is wrong) against the torch reference, for INT4 (modelopt AWQ) and NVFP4 weights."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.checkpoint.formats import dequantize_weight  # noqa: E402
from lowbit.kernels import w4a16  # noqa: E402
from lowbit.kernels.synthetic import quantize_linear  # noqa: E402

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
def test_kernel_matches_reference(fmt, m, k, group, split):
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
