"""W8A8 linear layers: FP8 (per-tensor static, or per-channel weights with dynamic per-token activations) and
INT8 SmoothQuant (smoothing + static per-tensor or dynamic per-token int8 activations, per-channel weights).

Activations are quantized by one fused Triton pass (act_quant), then
- FP8 at small M (decode): lowbit's Triton small-M GEMM (fp8_small_m), scales and bias in the same launch;
- FP8 otherwise: torch._scaled_mm (cuBLASLt) with per-tensor or row-wise scales, or the Triton scaled GEMM where it
  cannot run;
- INT8 at small M (decode): int8_gemv, dp4a on CUDA cores, up to INT8_GEMV_MAX_M rows; then the small-M GEMM's
  int8 form (int8_small_m_gemm) up to INT8_SMALL_M_MAX; otherwise the Triton int8 GEMM with a per-token x
  per-channel epilogue (scaled_gemm).
"""
import torch

from lowbit.kernels._triton import on_gpu
from lowbit.kernels.act_quant import act_quant, act_quant_ref
from lowbit.kernels import int8_gemv
from lowbit.kernels.dense_gemv import fp8_gemv
from lowbit.kernels.fp8_small_m import fp8_small_m_gemm, int8_small_m_gemm
from lowbit.kernels.scaled_gemm import scaled_gemm, scaled_gemm_ref


def scaled_mm_applies(q: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._scaled_mm needs an fp8-capable GPU (sm_89+) and K, N multiples of 16."""
    return (q.is_cuda and q.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(q.device) >= (8, 9)
            and q.shape[1] % 16 == 0 and w.shape[0] % 16 == 0)


# Static FP8 with per-row weight scales (merged parts kept exact: Qwen3's q/k/v) where fp8_small_m does not run: up
# to this M, the per-tensor GEMM into fp32 and then the column scales beats cuBLAS's row-wise kernel
# (H200, 2026-11-30: qkv M=1 12.8 vs 19.1 us, gate_up 33.9 vs 45.5).
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


# Largest M routed to fp8_small_m, by scale kind (H200, 2026-11-30, docs/kernels_notes.md "FP8 small-M GEMM"):
# per-row weight scales: faster than the fp32 route up to M = 32 (qkv 9.1 vs 12.3 us at M = 1); per-token x scales:
# faster than cuBLAS row-wise (7.6 vs 14.6 us, 4096->4096). Per-tensor (every merged layer on CUDA since its part
# scales are deferred, lowbit.serve.fuse): only for long K; `python3 bench/fp8_small_m.py --ladder`, H200,
# 2026-12-01 00:05 UTC, M = 1..24: down 14336->4096 18.5-19.7 us vs _scaled_mm 19.6-20.3, while _scaled_mm wins at
# K = 4096 (o 7.2-7.5 vs 10.6-11.6, qkv 9.4-9.9 vs 10.5-12.0, gate_up 30.2-31.6 vs 31.5-34.2 but for M = 2).
SMALL_M_MAX = {"per_tensor": 24, "per_row": 32, "per_token": 32}
SMALL_M_PER_TENSOR_MIN_K = 8192
# One row of a layer of at most FP8_GEMV_MAX_WEIGHTS runs the CUDA-core fp8_gemv (H200, benchmarks.md run 41:
# qkv 4096->6144 8.2 vs 9.9 us, o 4096->4096 7.6 vs 7.3; fp8 batch-1 step 2.778 -> 2.739 ms); larger layers keep
# fp8_small_m / _scaled_mm (gate_up 33.8 vs 30.5 us, down 21.8 vs 18.1).
FP8_GEMV_MAX_WEIGHTS = 4096 * 6144
FP8_GEMV_CONFIG = (8, 1024, 2)  # (BLOCK_N, BLOCK_K, num_warps)
# INT8 (SmoothQuant) layers at up to INT8_GEMV_MAX_M x rows run int8_gemv (dp4a on CUDA cores); from there up to
# INT8_SMALL_M_MAX rows the small-M GEMM's int8 form (swap-AB int8 wgmma, split K finished in the same launch); the
# int8 GEMM's tiles are made for large M. H200, ms per token of the four Llama-3.1-8B linears x 32 layers
# (`python3 bench/int8_small_m_bench.py`, benchmarks.md run 50 calls 5 and 7), int8_gemv / small-M / int8 GEMM:
# M = 1 1.99 / 2.14 / 7.80, M = 2 2.14 / 2.19 / 7.60, M = 3 2.89 / 2.17 / 7.44, M = 8 4.30 / 2.17 / 7.06,
# M = 16 - / 2.21 / 6.64, M = 32 - / 2.29 / 5.18 (cuBLAS bf16 3.8-4.1).
INT8_GEMV_MAX_M = 2
INT8_SMALL_M_MAX = 32


def scale_kind(scale_a, scale_b) -> str:
    if scale_a.numel() > 1:
        return "per_token"
    return "per_row" if scale_b.numel() > 1 else "per_tensor"


def int8_gemv_applies(q, w, scale_a) -> bool:
    """INT8 x and weights on the GPU, at most INT8_GEMV_MAX_M rows, in the shapes int8_gemv supports."""
    return on_gpu(q) and q.shape[0] <= INT8_GEMV_MAX_M and int8_gemv.supports(q, w, scale_a)


def int8_small_m_applies(q, w) -> bool:
    """INT8 x and weights on Hopper (int8 wgmma), at most INT8_SMALL_M_MAX rows."""
    return (on_gpu(q) and q.dtype == w.dtype == torch.int8 and q.shape[0] <= INT8_SMALL_M_MAX
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


def fp8_gemv_applies(q, w, scale_a) -> bool:
    """One FP8 row (one activation scale) on Hopper, a layer of at most FP8_GEMV_MAX_WEIGHTS."""
    return (on_gpu(q) and q.shape[0] == 1 and scale_a.numel() == 1 and q.dtype == w.dtype == torch.float8_e4m3fn
            and w.numel() <= FP8_GEMV_MAX_WEIGHTS and torch.cuda.get_device_capability(q.device) >= (9, 0))


def small_m_applies(q, w, scale_a, scale_b) -> bool:
    """fp8_small_m runs on Hopper (fp8 wgmma; measured on the H200 only) up to SMALL_M_MAX rows."""
    kind = scale_kind(scale_a, scale_b)
    return (on_gpu(q) and q.dtype == torch.float8_e4m3fn and w.dtype == torch.float8_e4m3fn
            and q.shape[0] <= SMALL_M_MAX[kind] and torch.cuda.get_device_capability(q.device) >= (9, 0)
            and (kind != "per_tensor" or q.shape[1] >= SMALL_M_PER_TENSOR_MIN_K or not scaled_mm_applies(q, w)))


def scaled_mm(q, w, scale_a, scale_b, bias, out_dtype):
    """q [M, K] fp8, w [N, K] fp8; scale_a [] or [M, 1]; scale_b [] or [N]: the cuBLAS routes (scaled_mm_applies)."""
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
    if int8_gemv_applies(q, w, scale_a):
        return int8_gemv.int8_gemv(q, w, scale_a, w_scale, bias, out_dtype)
    if fp8_gemv_applies(q, w, scale_a):
        return fp8_gemv(q, w, scale_a, w_scale, bias, out_dtype, FP8_GEMV_CONFIG)
    return tensor_core_linear(q, w, w_scale, scale_a, bias, out_dtype)


def tensor_core_linear(q, w, w_scale, scale_a, bias, out_dtype):
    """w8a8_linear_prequantized without the one-row GEMVs: the small-M GEMM, cuBLAS or the Triton GEMM."""
    if int8_small_m_applies(q, w):
        return int8_small_m_gemm(q, w, scale_a, w_scale, bias, out_dtype)
    if small_m_applies(q, w, scale_a, w_scale):  # also where K or N is no multiple of 16
        return fp8_small_m_gemm(q, w, scale_a, w_scale, bias, out_dtype)
    if scaled_mm_applies(q, w):
        return scaled_mm(q, w, scale_a, w_scale, bias, out_dtype)
    return scaled_gemm(q, w, scale_a, w_scale, bias, out_dtype)
