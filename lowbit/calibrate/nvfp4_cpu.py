"""A CPU kernel for modelopt's NVFP4 dynamic block fake quantization.

modelopt 0.47 routes every dynamic block quantizer (NVFP4 weights and activations) through the torch operator
`tensorrt::dynamic_block_quantize_op`; its only implementation asserts a CUDA tensor (ENV.md). `install()` registers
a pure-torch kernel for that operator under the CPU dispatch key, so CUDA tensors keep modelopt's Triton kernel and
nothing above the operator (quantizers, calibration, export) changes. Other block formats on CPU still reach
modelopt's own implementation and fail there as before.

The kernel reproduces modelopt's `fp4_fake_quant_block` (Triton) step by step:
  global_scale = amax / (6 * 448)                         (amax: the calibrated per-tensor amax)
  block_scale  = e4m3(min(block_amax / (6 * global_scale), 448)) * global_scale, 1.0 where it is < 1e-5
  y            = sign(x) * round_e2m1(|x| / block_scale) * block_scale
with e2m1 rounding to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code.
"""
import warnings

import torch

OP = "dynamic_block_quantize_op"
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MIN_BLOCK_SCALE = 1e-5  # below this modelopt's kernel uses a block scale of 1.0
# (upper bound of a rounding interval, value, bound included in the interval): ties go to the even code
_E2M1_STEPS = ((0.25, 0.0, True), (0.75, 0.5, False), (1.25, 1.0, True), (1.75, 1.5, False),
               (2.5, 2.0, True), (3.5, 3.0, False), (5.0, 4.0, True))

_library = None  # keeps the registration alive; registering twice is a no-op


def round_e2m1(mag: torch.Tensor) -> torch.Tensor:
    """|x| / scale (float32, >= 0) -> the nearest e2m1 magnitude."""
    out = torch.full_like(mag, E2M1_MAX)
    for bound, value, inclusive in reversed(_E2M1_STEPS):
        inside = mag <= bound if inclusive else mag < bound
        out = torch.where(inside, torch.full_like(mag, value), out)
    return out


def nvfp4_fake_quant(x: torch.Tensor, amax: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """x [..., n] (n % block_size == 0), amax: calibrated global amax -> fake-quantized x, same dtype."""
    if x.shape[-1] % block_size:
        raise ValueError(f"NVFP4 fake quant: last dimension {x.shape[-1]} is not a multiple of {block_size}")
    blocks = x.float().reshape(*x.shape[:-1], -1, block_size)
    global_scale = amax.float().amax() / (E2M1_MAX * E4M3_MAX)
    global_scale = torch.where(global_scale > 0, global_scale, torch.full_like(global_scale, 1e-12))
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    in_fp8_range = (block_amax / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX)
    scale = in_fp8_range.to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= MIN_BLOCK_SCALE, scale, torch.ones_like(scale))
    y = round_e2m1(blocks.abs() / scale) * scale
    y = torch.where(blocks >= 0, y, -y)
    return y.reshape(x.shape).to(x.dtype)


def _kernel(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
    is_nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4)
    if not is_nvfp4 or amax is None:
        from modelopt.torch.quantization.tensor_quant import _dynamic_block_quantize_impl

        return _dynamic_block_quantize_impl(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits,
                                            scale_exponent_bits)
    return nvfp4_fake_quant(inputs, amax, block_size)


def install() -> None:
    """Register the CPU kernel (idempotent). Import modelopt's quantization first: it defines the operator."""
    global _library
    if _library is not None:
        return
    import modelopt.torch.quantization.tensor_quant  # noqa: F401  (defines tensorrt::dynamic_block_quantize_op)

    library = torch.library.Library("tensorrt", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the CPU kernel is overridden: intended
        library.impl(OP, _kernel, "CPU", allow_override=True)
    _library = library
