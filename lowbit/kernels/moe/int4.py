"""INT4 (W4A16, AWQ) experts of the fused MoE: their scales, the torch reference of one expert's linear, and the
grouped GEMM that multiplies the packed nibbles in its K loop and applies each group's scale to the partial sums.

Weights keep modelopt's on-disk layout, stacked: uint8 [E, N/2, K], output row 2j in the low nibble of byte row j and
row 2j + 1 in the high one (two's complement, no zero point); a merged gate/up concatenates gate's byte rows and up's
(N/2 each half's rows, so N = 2I keeps each half's parity). Scales fp32 [E, N, K/group]; pre_quant_scale (AWQ's
smoothing) [E, K] per expert, multiplied into that expert's gathered input rows in x's dtype before the GEMM, as the
format's reference linear does (ones where the checkpoint has none).
"""
from typing import NamedTuple

import torch

from lowbit.formats.numerics import unpack_int4_rows
from lowbit.kernels._triton import cdiv, helper, kernel, tl, wait_for_producers
from lowbit.kernels.moe.align import block_rows

BLOCK_N = 64  # output columns per program (BLOCK_N / 2 byte rows)
MAX_BLOCK_K = 64  # the K step: min(this, group), so one scale per column per step


class Int4Scales(NamedTuple):
    """Scales of INT4 experts (fp32 on the weights' device): w13_scale [E, 2I, H / g13], w13_smooth [E, H],
    w2_scale [E, H, I / g2], w2_smooth [E, I]."""
    w13_scale: torch.Tensor
    w13_smooth: torch.Tensor
    w2_scale: torch.Tensor
    w2_smooth: torch.Tensor


def int4_group(w: torch.Tensor, scale: torch.Tensor) -> int:
    """The quantization group along K of packed weights w [E, N/2, K] with scales [E, N, K/group]."""
    k, groups = w.shape[2], scale.shape[2]
    if k % groups or tuple(scale.shape[:2]) != (w.shape[0], 2 * w.shape[1]):
        raise ValueError(f"INT4 experts: scales {tuple(scale.shape)} do not fit packed weights {tuple(w.shape)}")
    return k // groups


def int4_linear_ref(a: torch.Tensor, w: torch.Tensor, e: int, scale: torch.Tensor, smooth: torch.Tensor):
    """a [M, K] through expert e: (a * smooth[e] in a's dtype) @ dequantized w[e]^T in fp32, returned in a's dtype
    (formats.W4A16_AWQ.reference_linear)."""
    xs = (a * smooth[e].to(a.dtype)).float()
    q = unpack_int4_rows(w[e]).float()
    return (xs @ (q * scale[e].float().repeat_interleave(int4_group(w, scale), dim=1)).t()).to(a.dtype)


def block_k(group: int) -> int:
    """The K step of the INT4 kernels: a divisor of the group, at least 16 (tl.dot)."""
    if group % 16:
        raise ValueError(f"INT4 experts: group {group} is not a multiple of 16")
    return min(MAX_BLOCK_K, group)


def grouped_gemm_int4(a, w, scale, smooth, sorted_ids, block_expert, num_pairs: int, a_row_div: int,
                      block_m: int) -> torch.Tensor:
    """out[i] = (a[i // a_row_div] * smooth[e]) @ dequant(w[e])^T, e the expert of pair i, for every pair listed in
    sorted_ids: [num_pairs, N] in a's dtype (fused_moe.grouped_gemm's contract, INT4 weights)."""
    e, half, kdim = w.shape
    group = int4_group(w, scale)
    if w.dtype != torch.uint8 or a.stride(-1) != 1 or tuple(smooth.shape) != (e, kdim):
        raise ValueError(f"grouped_gemm_int4: uint8 w [E, N/2, K] and smooth [E, K]; got {w.dtype} "
                         f"{tuple(w.shape)}, {tuple(smooth.shape)}")
    scale, smooth, w = scale.float().contiguous(), smooth.float().contiguous(), w.contiguous()
    out = torch.empty(num_pairs, 2 * half, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(2 * half, BLOCK_N))
    _grouped_int4_kernel[grid](a, w, scale, smooth, out, sorted_ids, block_expert, num_pairs, half, kdim, a.stride(0),
                               out.stride(0), A_ROW_DIV=a_row_div, GROUP=group, IEEE=a.dtype == torch.float32,
                               BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k(group))
    return out


@helper
def int4_nibbles(b):
    """int32 bytes -> (low, high) nibbles as signed int32 in [-8, 7]."""
    lo = b & 15
    hi = (b >> 4) & 15
    return lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)


@kernel
def _grouped_int4_kernel(a_ptr, w_ptr, s_ptr, smooth_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, HALF_N, K,
                         stride_am, stride_om, A_ROW_DIV: tl.constexpr, GROUP: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_M sorted rows of one expert x BLOCK_N output columns (BLOCK_N / 2 byte rows: the even
    columns accumulate the low nibbles, the odd ones the high)."""
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    wait_for_producers(PDL)
    if expert < 0:  # past the last expert's run
        return
    e64 = expert.to(tl.int64)
    pairs, row_ok, a_rows = block_rows(sorted_ptr, pid_m, num_pairs, A_ROW_DIV, BLOCK_M)
    brow = pid_n * HALF + tl.arange(0, HALF)  # byte rows: output columns 2 * brow and 2 * brow + 1
    b_ok = brow < HALF_N
    w_base = w_ptr + e64 * HALF_N * K + brow[None, :].to(tl.int64) * K
    groups = K // GROUP
    s_even = s_ptr + e64 * 2 * HALF_N * groups + (2 * brow).to(tl.int64) * groups
    acc_lo = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None], other=0.0)
        sm = tl.load(smooth_ptr + e64 * K + ks).to(a.dtype)
        a = (a * sm[None, :]).to(a_ptr.dtype.element_ty)  # rounded to x's dtype, as the reference
        b = tl.load(w_base + ks[:, None], mask=b_ok[None, :], other=0).to(tl.int32)  # [BLOCK_K, HALF]
        lo, hi = int4_nibbles(b)
        g = k0 // GROUP
        sc_lo = tl.load(s_even + g, mask=b_ok, other=0.0)
        sc_hi = tl.load(s_even + groups + g, mask=b_ok, other=0.0)
        if IEEE:  # fp32 operands: full precision, not TF32
            p_lo = tl.dot(a, lo.to(tl.float32), input_precision="ieee")
            p_hi = tl.dot(a, hi.to(tl.float32), input_precision="ieee")
        else:  # int4 values are exact in 16 bits; the group scale multiplies the fp32 partial sums
            p_lo = tl.dot(a, lo.to(a_ptr.dtype.element_ty))
            p_hi = tl.dot(a, hi.to(a_ptr.dtype.element_ty))
        acc_lo += p_lo * sc_lo[None, :]
        acc_hi += p_hi * sc_hi[None, :]
    out_rows = tl.where(row_ok, pairs, 0).to(tl.int64)[:, None] * stride_om
    ok = row_ok[:, None] & b_ok[None, :]
    tl.store(out_ptr + out_rows + 2 * brow[None, :], acc_lo.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + out_rows + 2 * brow[None, :] + 1, acc_hi.to(out_ptr.dtype.element_ty), mask=ok)
