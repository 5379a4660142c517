"""NVFP4 and INT4 reference functions against independent implementations.

- lowbit's CPU kernel for modelopt's dynamic block quantizer (calibrate/nvfp4_cpu.py: threshold rounding, modelopt's
  Triton algorithm) equals formats.fake_quant_nvfp4 (argmin rounding over the e2m1 table), exactly, including ties;
- it is what modelopt's quantizer op runs on CPU once installed;
- formats.nvfp4_quantize / pack_e2m1 equal modelopt's export function (NVFP4QTensor.quantize) bit for bit,
  including all-zero blocks and negative zeros; formats.pack_int4_rows equals modelopt's int4 export packing.
"""
import pytest
import torch

from lowbit.calibrate import nvfp4_cpu
from lowbit import formats

TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
TIE_RESULTS = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # to the even e2m1 code


def activations(seed: int = 0) -> torch.Tensor:
    """[64, 576] values spanning four decades per block, one all-zero row, exact e2m1 ties in one row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 576, generator=g) * torch.logspace(-2, 2, 64).unsqueeze(1)
    x[3] = 0
    x[5, :16] = torch.cat([TIES, -TIES, torch.tensor([6.0, -6.0])])
    return x


def test_e2m1_rounding_ties_go_to_even_in_both_implementations():
    assert torch.equal(nvfp4_cpu.round_e2m1(TIES), TIE_RESULTS)
    assert torch.equal(formats.e2m1_decode(formats.e2m1_codes(TIES)), TIE_RESULTS)
    assert torch.equal(formats.e2m1_decode(formats.e2m1_codes(-TIES)), -TIE_RESULTS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_kernel_equals_independent_reference(seed):
    x = activations(seed)
    amax = x.abs().amax()
    expected = formats.fake_quant_nvfp4(x, amax / (6 * 448))
    assert torch.equal(nvfp4_cpu.nvfp4_fake_quant(x, amax), expected)
    assert torch.equal(nvfp4_cpu.nvfp4_fake_quant(x.reshape(4, 16, 576), amax), expected.reshape(4, 16, 576))


def test_modelopt_quantizer_runs_the_cpu_kernel():
    import modelopt.torch.quantization as mtq  # noqa: F401
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    nvfp4_cpu.install()
    q = TensorQuantizer(QuantizerAttributeConfig(**mtq.NVFP4_DEFAULT_CFG["quant_cfg"][1]["cfg"]))
    x = activations()
    q.amax = x.abs().amax()
    with torch.no_grad():
        y = q(x)
    assert torch.equal(y, formats.fake_quant_nvfp4(x, x.abs().amax() / (6 * 448)))


def test_nvfp4_quantize_equals_modelopt_export():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = activations() * 0.01
    w[7, 32:48] = 0  # an all-zero block: modelopt writes block scale 1.0
    global_scale = w.abs().amax().float() / (6 * 448)
    packed, block_scale, global_2 = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=global_scale)
    codes, scale = formats.nvfp4_quantize(w, global_scale)
    assert torch.equal(scale.view(torch.uint8), block_scale.view(torch.uint8))
    assert torch.equal(formats.pack_e2m1(codes), packed._quantized_data)
    assert torch.equal(formats.unpack_e2m1(packed._quantized_data), codes)
    assert scale[7, 2].float() == 1.0


def test_int4_row_packing_equals_modelopt_export():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    scale = w.reshape(64, -1, 128).abs().amax(-1) / 7  # [out, in/128]
    packed = pack_int4_in_uint8(w, scale, 128)
    q = (w / scale.repeat_interleave(128, dim=1)).round().clamp(-8, 7).to(torch.int8)
    assert torch.equal(formats.pack_int4_rows(q), packed)
    assert torch.equal(formats.unpack_int4_rows(packed), q)
    t = {"weight": packed, "weight_scale": scale}
    torch.testing.assert_close(formats.dequantize_weight("W4A16_AWQ", t), q.float() * scale.repeat_interleave(128, 1))
