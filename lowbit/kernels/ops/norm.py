"""RMSNorm with the residual add fused in: out = weight * normalize(x + residual), new_residual = x + residual.

With quant_scale (the next FP8 linear's static input_scale, fp32 []) the output is written as float8_e4m3fn,
out / quant_scale (the kernel multiplies by 1 / quant_scale: one fp32 rounding apart, which changes an FP8 code only
at an exact rounding tie): the activation quantization of that linear then costs nothing (see linear's fp8 input).
"""
import torch

from lowbit.formats import FP8_MAX
from lowbit.kernels._triton import kernel, next_pow2, on_gpu, tl, wait_for_producers


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 quant_scale: torch.Tensor | None = None):
    """x, residual [..., D]; weight [D]. Rounds like HF Llama: the sum and the normalized x in x's dtype."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return (out if quant_scale is None else quantize_fp8_ref(out, quant_scale)), x


def quantize_fp8_ref(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (y.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@kernel
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, D, eps,
                     HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    # the weight (and FP8 scale) never change while serving: loaded before the wait, they are in flight while the
    # kernel before finishes under PDL (bf16 batch-1 graph replay on the H200: ~1 % faster)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        inv_scale = tl.div_rn(1.0, tl.load(scale_ptr))  # one division per row, not per element
    wait_for_producers(PDL)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype).to(tl.float32)
        tl.store(res_out_ptr + row * D + cols, x.to(dtype), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    y = (normed * w).to(dtype)
    if QUANT:
        v = y.to(tl.float32) * inv_scale
        tl.store(out_ptr + row * D + cols, tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptr + row * D + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quant_scale: torch.Tensor | None = None):
    """-> (out, new_residual): new_residual = x + residual, or x itself when residual is None."""
    if not on_gpu(x):
        return rms_norm_ref(x, weight, eps, residual, quant_scale)
    return rms_norm_triton(x, weight, eps, residual, quant_scale)


def rms_norm_triton(x, weight, eps, residual=None, quant_scale=None):
    shape = x.shape
    D = shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    out = torch.empty_like(x2, dtype=x.dtype if quant_scale is None else torch.float8_e4m3fn)
    if residual is None:
        res2, res_out = x2, x2
    else:
        res2 = residual.reshape(-1, D).contiguous()
        res_out = torch.empty_like(x2)
    block = next_pow2(D)
    _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight, out, res_out, quant_scale if quant_scale is not None else x2,
                                     D, eps, HAS_RESIDUAL=residual is not None, QUANT=quant_scale is not None,
                                     BLOCK=block,
                                     num_warps=min(16, max(1, block // 512)))
    return out.reshape(shape), (x if residual is None else res_out.reshape(shape))
