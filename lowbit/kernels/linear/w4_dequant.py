"""Weight-only 4-bit linear at large M (prefill, large decode batches): dequantize the layer's weight into a 16-bit
scratch [N, K] (one Triton launch, fp32 math rounded once to x's dtype), then one cuBLAS GEMM.

At large M the GEMM is compute-bound and cuBLAS's bf16 tensor-core kernels are ~2.5x faster than w4a16's
dequantize-in-the-loop kernel (which dequantizes each weight once per M tile); the dequantization costs one read of
the 4-bit weights and one write of the 16-bit ones (~0.3 GB for a 4096 x 28672 layer), once per call.
Same layout as lowbit.kernels.linear.w4a16 (W4Weight): qweight int32 [N, KP/8], nibble s of word j = element 8j+s;
INT4 scales fp32 [KP/group, N] (value (u - 8) x scale); NVFP4 scales e4m3 [KP/128, N, 8] x the global scale.
The scratch is one buffer per device and dtype (lowbit.kernels.linear.scratch: grown outside CUDA-graph capture, never
freed), shared by every layer. While a graph is captured with too small a scratch, `dequant_linear` returns None
(the caller runs another kernel).
"""
import torch
import torch.nn.functional as F

from lowbit.kernels.linear import scratch
from lowbit.kernels._triton import cdiv, kernel, tl, wait_for_producers

BLOCK_N, BLOCK_K = 32, 256  # one program's tile of the weight; BLOCK_K a multiple of 128 (an NVFP4 scale tile)


def dequantize_into(w, out: torch.Tensor) -> torch.Tensor:
    """w a W4Weight -> out [N, K] (16-bit, contiguous) = its dequantized weight (global scale included)."""
    N, K = w.out_features, w.in_features
    assert out.shape == (N, K) and out.is_contiguous()
    grid = (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))
    _dequant_kernel[grid](w.qweight, w.scales, out, N, K, w.qweight.shape[1], w.global_scale,
                          IS_FP4=w.fmt == "nvfp4", GROUP=w.group, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


def dequant_linear(x: torch.Tensor, w, bias=None) -> torch.Tensor | None:
    """x [M, K] bf16/fp16 -> [M, N] = (x * smooth) @ dequant(w)^T (+ bias) in x's dtype, or None while a CUDA graph
    is captured and the scratch is too small."""
    N, K = w.out_features, w.in_features
    buf = scratch.grown("w4 dequantized weight", x.device, x.dtype, N * K)
    if buf is None:
        return None
    wd = dequantize_into(w, buf[: N * K].view(N, K))
    if w.smooth is not None:  # x * pre_quant_scale rounded to x's dtype, as w4a16_gemm_ref
        x = x * w.smooth.to(x.dtype)
    return F.linear(x, wd, bias.to(x.dtype) if bias is not None else None)


@kernel
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, w_stride, global_scale, IS_FP4: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[n, k] for a [BLOCK_N, BLOCK_K] tile; words [BN, BK/8] expanded to nibbles [BN, BK/8, 8] by shifts."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(n, N - 1).to(tl.int64)  # clamped: loads need no mask on N, the store is masked
    j = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # word index along K
    words = tl.load(w_ptr + n_rows[:, None] * w_stride + j[None, :], mask=(j < w_stride)[None, :], other=0)
    u = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF  # [BN, BK/8, 8]
    u = tl.reshape(u, (BLOCK_N, BLOCK_K))
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    if IS_FP4:
        # the code's (e1 e0 m) at bits 9..11 and its sign at bit 15 of an fp16 = the e2m1 value x 2^-14 exactly
        # (e = 0: the subnormals 0 and 2^-15)
        h = ((u & 8) << 12) | ((u & 7) << 9)
        v = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        b = k0 // 16 + tl.arange(0, BLOCK_K // 16)  # 16-blocks of the tile
        sc = tl.load(s_ptr + ((b // 8)[None, :] * N + n_rows[:, None]) * 8 + (b % 8)[None, :],
                     mask=(b < w_stride // 2)[None, :], other=0.0).to(tl.float32) * (global_scale * 16384.0)
        v = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 16)) * sc[:, :, None], (BLOCK_N, BLOCK_K))
    elif BLOCK_K % GROUP == 0:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # groups of the tile
        sc = tl.load(s_ptr + g[None, :] * N + n_rows[:, None], mask=(g < w_stride * 8 // GROUP)[None, :], other=0.0)
        v = (u - 8).to(tl.float32)
        v = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * sc[:, :, None], (BLOCK_N, BLOCK_K))
    else:  # groups wider than the tile, or straddling it: one scale load per element
        sc = tl.load(s_ptr + (k // GROUP)[None, :] * N + n_rows[:, None], mask=(k < w_stride * 8)[None, :], other=0.0)
        v = (u - 8).to(tl.float32) * sc
    wait_for_producers(PDL)  # the scratch may still be read by the GEMM before (the previous layer's)
    tl.store(out_ptr + n[:, None].to(tl.int64) * K + k[None, :], v.to(out_ptr.dtype.element_ty),
             mask=(n < N)[:, None] & (k < K)[None, :])
