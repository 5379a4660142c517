"""W8A8 linear layers: FP8 (per-tensor static, or per-channel weights with dynamic per-token activations) and
INT8 SmoothQuant (smoothing + static per-tensor or dynamic per-token int8 activations, per-channel weights).

Activations are quantized by one fused Triton pass (act_quant), then
- FP8: torch._scaled_mm (cuBLASLt) with per-tensor or row-wise scales, or the Triton scaled GEMM where it cannot run;
- INT8: the Triton int8 GEMM with a per-token x per-channel epilogue (scaled_gemm).
"""
import torch

from lowbit.kernels.act_quant import act_quant, act_quant_ref
from lowbit.kernels.scaled_gemm import scaled_gemm, scaled_gemm_ref


def scaled_mm_applies(q: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._scaled_mm needs an fp8-capable GPU (sm_89+) and K, N multiples of 16."""
    return (q.is_cuda and q.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(q.device) >= (8, 9)
            and q.shape[1] % 16 == 0 and w.shape[0] % 16 == 0)


# Static FP8 with per-row weight scales (merged q/k/v, gate/up): up to this M, the per-tensor GEMM into fp32 and then
# the column scales beats cuBLAS's row-wise kernel (H200, 2026-11-30: qkv M=1 12.8 vs 19.1 us, gate_up 33.9 vs 45.5).
PER_TENSOR_THEN_SCALE_MAX_M = 32
_ONES: dict = {}


def _per_tensor_then_column_scale(q, w, scale_a, scale_b, bias, out_dtype):
    if q.device not in _ONES:
        _ONES[q.device] = torch.ones((), device=q.device)
    one = _ONES[q.device]
    y = torch._scaled_mm(q, w.t(), scale_a=scale_a.float().reshape(()), scale_b=one, out_dtype=torch.float32)
    out = torch.empty(y.shape, dtype=out_dtype, device=y.device)
    col = scale_b.float().reshape(1, -1)
    if bias is None:  # one elementwise kernel: fp32 product, rounded once into out
        return torch.mul(y, col, out=out)
    return torch.addcmul(bias.float().reshape(1, -1), y, col, out=out)


def scaled_mm(q, w, scale_a, scale_b, bias, out_dtype):
    """q [M, K] fp8, w [N, K] fp8; scale_a [] or [M, 1]; scale_b [] or [N]."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return torch._scaled_mm(q, w.t(), scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()),
                                bias=bias.to(out_dtype) if bias is not None else None, out_dtype=out_dtype)
    m, n = q.shape[0], w.shape[0]
    if scale_a.numel() == 1 and m <= PER_TENSOR_THEN_SCALE_MAX_M:
        return _per_tensor_then_column_scale(q, w, scale_a, scale_b, bias, out_dtype)
    sa = scale_a.float().expand(m, 1).contiguous()
    sb = scale_b.float().reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # row-wise needs bf16 out
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)


def w8a8_linear_ref(x, w, w_scale, input_scale=None, smooth=None, bias=None):
    """x [M, K] bf16/fp16; w [N, K] float8_e4m3fn or int8; w_scale fp32 [] or [N]; input_scale fp32 [] or None."""
    q, sa = act_quant_ref(x, w.dtype, input_scale, smooth)
    return scaled_gemm_ref(q, w, sa, w_scale, bias, x.dtype)


def w8a8_linear(x, w, w_scale, input_scale=None, smooth=None, bias=None):
    q, sa = act_quant(x, w.dtype, input_scale, smooth)
    return w8a8_linear_prequantized(q, w, w_scale, sa, bias, x.dtype)


def w8a8_linear_prequantized(q, w, w_scale, scale_a, bias, out_dtype):
    """q [M, K] already quantized (x ~= q * scale_a), e.g. by a producer kernel's fp8 epilogue."""
    if scaled_mm_applies(q, w):
        return scaled_mm(q, w, scale_a, w_scale, bias, out_dtype)
    return scaled_gemm(q, w, scale_a, w_scale, bias, out_dtype)
