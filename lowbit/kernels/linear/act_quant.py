"""Activation quantization for W8A8 GEMMs, one fused pass over x [M, K]:
optional smoothing (x * pre_quant_scale, rounded to x's dtype), then fp8-e4m3 or int8 quantization with either a
static per-tensor scale (the checkpoint's input_scale) or a dynamic per-token scale amax_row / qmax.

Returns (q [M, K] float8_e4m3fn | int8, scale fp32: [] when static, [M, 1] when dynamic); x ~= q * scale.
"""
import torch

from lowbit.formats import FP8_MAX, INT8_MAX
from lowbit.kernels._triton import cdiv, helper, kernel, next_pow2, tl, use_triton, wait_for_producers

_MIN_SCALE = 1e-12


def act_quant_ref(x, out_dtype, scale=None, smooth=None):
    """x [M, K] (bf16/fp16); out_dtype torch.float8_e4m3fn or torch.int8; scale fp32 scalar or None (dynamic)."""
    if smooth is not None:
        x = x * smooth.to(x.dtype)
    xf = x.float()
    qmax = FP8_MAX if out_dtype == torch.float8_e4m3fn else INT8_MAX
    if scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_MIN_SCALE)
    else:
        scale = scale.float().reshape(())
    v = xf / scale
    if out_dtype == torch.int8:
        return v.round().clamp(-qmax, qmax).to(torch.int8), scale
    return v.clamp(-qmax, qmax).to(torch.float8_e4m3fn), scale


@helper
def _smoothed(x_ptr, smooth_ptr, row, cols, K, HAS_SMOOTH: tl.constexpr):
    """x[row, cols] (* smooth[cols], rounded to x's dtype) as fp32; zero past K."""
    x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0)
    if HAS_SMOOTH:
        s = tl.load(smooth_ptr + cols, mask=cols < K, other=0.0).to(x.dtype)
        x = (x.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@kernel
def _act_quant_kernel(x_ptr, smooth_ptr, scale_ptr, q_ptr, K,
                      HAS_SMOOTH: tl.constexpr, DYNAMIC: tl.constexpr, IS_INT8: tl.constexpr,
                      QMAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # static: program (row, chunk) quantizes BLOCK elements; dynamic: program (row, 0) loops over the row twice
    # (amax, then quantize: the second read hits L2)
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if DYNAMIC:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(_smoothed(x_ptr, smooth_ptr, row, k0 + cols, K, HAS_SMOOTH)))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), QMAX), 1e-12)
        tl.store(scale_ptr + row, scale)
        k_begin, k_end = 0, K
    else:
        scale = tl.load(scale_ptr)
        k_begin = tl.program_id(1) * BLOCK
        k_end = k_begin + BLOCK
    for k0 in range(k_begin, k_end, BLOCK):
        xf = _smoothed(x_ptr, smooth_ptr, row, k0 + cols, K, HAS_SMOOTH)
        v = tl.minimum(tl.maximum(tl.div_rn(xf, scale), -QMAX), QMAX)  # IEEE division, as torch rounds it
        if IS_INT8:
            v = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds |v| < 2**22 to nearest, ties to even
        tl.store(q_ptr + row * K + k0 + cols, v.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)


def act_quant(x, out_dtype, scale=None, smooth=None):
    if not use_triton(x):
        return act_quant_ref(x, out_dtype, scale, smooth)
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=out_dtype, device=x.device)
    if scale is None:
        scale_t = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    else:
        scale_t = scale.float().reshape(()).to(x.device)
    # static: 2048-wide chunks, all in parallel; dynamic: one program per row, one pass up to K = 16384
    block = min(2048, next_pow2(K)) if scale is not None else min(16384, next_pow2(K))
    grid = (M, 1 if scale is None else cdiv(K, block))
    _act_quant_kernel[grid](x, smooth if smooth is not None else x, scale_t, q, K,
                            HAS_SMOOTH=smooth is not None, DYNAMIC=scale is None,
                            IS_INT8=out_dtype == torch.int8,
                            QMAX=INT8_MAX if out_dtype == torch.int8 else FP8_MAX,
                            BLOCK=block, num_warps=max(4, min(16, block // 1024)))
    return q, scale_t
