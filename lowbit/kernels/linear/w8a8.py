"""W8A8 linear layers: FP8 (per-tensor static, or per-channel weights with dynamic per-token activations) and
INT8 SmoothQuant (smoothing + static per-tensor or dynamic per-token int8 activations, per-channel weights).

Activations are quantized by one fused Triton pass (act_quant), then
- FP8 at small M (decode): lowbit's Triton small-M GEMM (fp8_small_m), scales and bias in the same launch;
- FP8 otherwise: torch._scaled_mm (cuBLASLt) with per-tensor or row-wise scales, or the Triton scaled GEMM where it
  cannot run;
- INT8 at small M (decode): int8_gemv, dp4a on CUDA cores; then the small-M GEMM's int8 form (int8_small_m_gemm);
  otherwise the Triton int8 GEMM with a per-token x per-channel epilogue (scaled_gemm).
Which one runs, by M, N, K, scale kind and GPU, is lowbit.kernels.routes' table; its thresholds are in
lowbit.kernels.tuning.
"""
import torch

from lowbit.kernels import routes, tuning
from lowbit.kernels._triton import capability, on_gpu
from lowbit.kernels.linear.act_quant import act_quant, act_quant_ref
from lowbit.kernels.linear import int8_gemv
from lowbit.kernels.linear.dense_gemv import fp8_gemv
from lowbit.kernels.linear.fp8_small_m import fp8_small_m_gemm, int8_small_m_gemm
from lowbit.kernels.linear.scaled_gemm import scaled_gemm, scaled_gemm_ref

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


def scale_kind(scale_a, scale_b) -> str:
    """The routes' scale kind: "per_token" (one x scale per row), else "per_row" (one weight scale per row) or
    "per_tensor"."""
    if scale_a.numel() > 1:
        return "per_token"
    return "per_row" if scale_b.numel() > 1 else "per_tensor"


def weight_kind(w: torch.Tensor) -> str:
    """The routes' weight kind of a W8A8 weight: "int8" or "fp8"."""
    return "int8" if w.dtype == torch.int8 else "fp8"


def _arch(q) -> tuple[int, int] | None:
    """The GPU architecture the routes see: q's GPU's where kernels launch for it, else None."""
    return capability(q.device) if on_gpu(q) else None


def _route(q, w, scale_a, scale_b, only=None, arch=None) -> str:
    """The kernel routes.LINEAR picks for this call (arch: default _arch(q))."""
    arch = arch or _arch(q)
    return routes.route("linear", weight_kind(w), q.shape[0], w.shape[0], q.shape[1], arch,
                        scale=scale_kind(scale_a, scale_b), only=only)


def scaled_mm(q, w, scale_a, scale_b, bias, out_dtype):
    """q [M, K] fp8, w [N, K] fp8; scale_a [] or [M, 1]; scale_b [] or [N]: cuBLAS, as its route for the scales."""
    kernel = _route(q, w, scale_a, scale_b, only=tuple(_SCALED_MM), arch=capability(q.device))
    return _SCALED_MM[kernel](q, w, scale_a, scale_b, bias, out_dtype)


def _scaled_mm_per_tensor(q, w, scale_a, scale_b, bias, out_dtype):
    return torch._scaled_mm(q, w.t(), scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()),
                            bias=bias.to(out_dtype) if bias is not None else None, out_dtype=out_dtype)


def _scaled_mm_rowwise(q, w, scale_a, scale_b, bias, out_dtype):
    m, n = q.shape[0], w.shape[0]
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
    return _run(_route(q, w, scale_a, w_scale), q, w, w_scale, scale_a, bias, out_dtype)


def tensor_core_linear(q, w, w_scale, scale_a, bias, out_dtype):
    """w8a8_linear_prequantized without the one-row GEMVs: the small-M GEMM, cuBLAS or the Triton GEMM."""
    return _run(_route(q, w, scale_a, w_scale, only=routes.W8A8_TENSOR_CORE), q, w, w_scale, scale_a, bias, out_dtype)


def _run(kernel, q, w, w_scale, scale_a, bias, out_dtype):
    """Runs the kernel a route named."""
    args = (q, w, scale_a, w_scale, bias, out_dtype)
    if kernel == "int8_gemv":
        return int8_gemv.int8_gemv(*args)
    if kernel == "fp8_gemv":
        return fp8_gemv(*args, tuning.current().fp8_gemv_config)
    if kernel == "int8_small_m":
        return int8_small_m_gemm(*args)
    if kernel == "fp8_small_m":
        return fp8_small_m_gemm(*args)
    if kernel == "scaled_gemm":
        return scaled_gemm(*args)
    return _SCALED_MM[kernel](*args)


_SCALED_MM = {"scaled_mm": _scaled_mm_per_tensor, "scaled_mm_then_scale": _per_tensor_then_column_scale,
              "scaled_mm_rowwise": _scaled_mm_rowwise}
