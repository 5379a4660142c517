"""The fused MoE's small-batch (decode) path: one program per (token, slot) pair and BLOCK_N output columns, reading
its expert's weight rows on CUDA cores; no sorting by expert and no row blocks padded to the grouped GEMM's M tile.

out[i] = a[i // a_row_div] @ w[ids[i]]^T for every pair i (ids: topk_ids flattened), [num_pairs, N] in a's dtype,
with fp32 accumulation; FP8 experts quantize the row with their own input scale and dequantize at the end (as the
grouped GEMM's epilogue); INT4 experts smooth the row in a's dtype and scale each group's partial sum (moe/int4.py).
A pair re-reads its expert's weights when another pair has the same expert: worth it while pairs are few.
"""
import torch

from lowbit.formats.numerics import FP8_MAX
from lowbit.kernels._triton import cdiv, kernel, tl, wait_for_producers
from lowbit.kernels.moe.int4 import block_k, int4_group, int4_nibbles

BLOCK_N = 32
BLOCK_K = 128


def token_scales(a: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 scales of rows a [M, K]: fp32 [M], amax(|row|) / 448 (floored as the format's reference)."""
    return (a.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)


def expert_gemv(a, w, ids, a_row_div: int, w_scale=None, a_scale=None) -> torch.Tensor:
    """16-bit (w in a's dtype) or FP8 experts (w float8_e4m3fn [E, N, K], w_scale [E, N], a_scale [E], or None:
    per-token scales of a's rows)."""
    num_pairs, (_, n, kdim) = ids.numel(), w.shape
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("expert_gemv: a and w need unit stride along K")
    fp8, per_token = w_scale is not None, w_scale is not None and a_scale is None
    if per_token:
        a_scale = token_scales(a)
    w_scale, a_scale = (w_scale.float().contiguous(), a_scale.float().contiguous()) if fp8 else (w, w)
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    _gemv_kernel[(num_pairs, cdiv(n, BLOCK_N))](a, w, ids.reshape(-1).contiguous(), out, w_scale, a_scale, n, kdim,
                                                a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                                A_ROW_DIV=a_row_div, FP8=fp8, PER_TOKEN=per_token,
                                                BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def expert_gemv_int4(a, w, scale, smooth, ids, a_row_div: int) -> torch.Tensor:
    """INT4 experts: w uint8 [E, N/2, K], scale fp32 [E, N, K / group], smooth [E, K] (moe/int4.py's layout)."""
    num_pairs, (_, half, kdim) = ids.numel(), w.shape
    group = int4_group(w, scale)
    scale, smooth, w = scale.float().contiguous(), smooth.float().contiguous(), w.contiguous()
    out = torch.empty(num_pairs, 2 * half, dtype=a.dtype, device=a.device)
    _gemv_int4_kernel[(num_pairs, cdiv(2 * half, BLOCK_N))](a, w, scale, smooth, ids.reshape(-1).contiguous(), out,
                                                            half, kdim, a.stride(0), out.stride(0),
                                                            A_ROW_DIV=a_row_div, GROUP=group, BLOCK_N=BLOCK_N,
                                                            BLOCK_K=block_k(group))
    return out


@kernel
def _gemv_kernel(a_ptr, w_ptr, ids_ptr, out_ptr, w_scale_ptr, a_scale_ptr, N, K, stride_am, stride_we, stride_wn,
                 stride_om, A_ROW_DIV: tl.constexpr, FP8: tl.constexpr, PER_TOKEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wait_for_producers(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = (pair // A_ROW_DIV).to(tl.int64)
    a_row = a_ptr + row * stride_am
    w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PER_TOKEN:  # one scale per row of a
        a_scale = tl.load(a_scale_ptr + row)
    elif FP8:
        a_scale = tl.load(a_scale_ptr + expert)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:  # the expert's static input scale (or the row's), as the grouped GEMM
            a = tl.minimum(tl.maximum(tl.div_rn(a, a_scale), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        b = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[None, :], axis=1)
    if FP8:
        acc = acc * a_scale * tl.load(w_scale_ptr + expert * N + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@kernel
def _gemv_int4_kernel(a_ptr, w_ptr, s_ptr, smooth_ptr, ids_ptr, out_ptr, HALF_N, K, stride_am, stride_om,
                      A_ROW_DIV: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    pair = tl.program_id(0)
    brow = tl.program_id(1) * HALF + tl.arange(0, HALF)  # byte rows: output columns 2 * brow, 2 * brow + 1
    b_ok = brow < HALF_N
    wait_for_producers(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert * HALF_N * K + brow[:, None].to(tl.int64) * K
    groups = K // GROUP
    s_even = s_ptr + expert * 2 * HALF_N * groups + (2 * brow).to(tl.int64) * groups
    acc_lo = tl.zeros((HALF,), dtype=tl.float32)
    acc_hi = tl.zeros((HALF,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of GROUP, GROUP of BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_row + ks)
        a = (a * tl.load(smooth_ptr + expert * K + ks).to(a.dtype)).to(a_ptr.dtype.element_ty).to(tl.float32)
        lo, hi = int4_nibbles(tl.load(w_rows + ks[None, :], mask=b_ok[:, None], other=0).to(tl.int32))
        g = k0 // GROUP
        acc_lo += tl.sum(lo.to(tl.float32) * a[None, :], axis=1) * tl.load(s_even + g, mask=b_ok, other=0.0)
        acc_hi += tl.sum(hi.to(tl.float32) * a[None, :], axis=1) * tl.load(s_even + groups + g, mask=b_ok, other=0.0)
    out_row = out_ptr + pair.to(tl.int64) * stride_om + 2 * brow
    tl.store(out_row, acc_lo.to(out_ptr.dtype.element_ty), mask=b_ok)
    tl.store(out_row + 1, acc_hi.to(out_ptr.dtype.element_ty), mask=b_ok)
