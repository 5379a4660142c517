"""The fused MoE's small-batch (decode) path: one program per (token, slot) pair, BLOCK_N output columns and K split,
reading its expert's weight rows on CUDA cores; no sorting by expert and no row blocks padded to the grouped GEMM's M
tile.

out[i] = a[i // a_row_div] @ w[ids[i]]^T for every pair i (ids: topk_ids flattened), [num_pairs, N] in a's dtype,
with fp32 accumulation; FP8 experts quantize the row with their own input scale and dequantize at the end (as the
grouped GEMM's epilogue); INT8 experts smooth and quantize the row with their own pre_quant_scale and input scale and
sum exact int32 products (moe/int8.py); INT4 experts smooth the row in a's dtype and scale each group's partial sum
(moe/int4.py). A pair re-reads its expert's weights when another pair has the same expert: worth it while pairs are
few.

Tiles are tuning data: Tuning.moe_gemv_config[kind] = (BLOCK_N, BLOCK_K, num_warps, split). split > 1 cuts K into
that many ranges of whole BLOCK_K steps, one program each; they write fp32 partial rows [split, pairs, N] that one
torch sum adds up and rounds to a's dtype (two passes, deterministic).
"""
import torch

from lowbit.formats.numerics import FP8_MAX
from lowbit.kernels import tuning
from lowbit.kernels._triton import cdiv, kernel, tl, wait_for_producers
from lowbit.kernels.moe.int4 import int4_group, int4_nibbles
from lowbit.kernels.moe.int8 import check_int8, quantize_int8


def token_scales(a: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 scales of rows a [M, K]: fp32 [M], amax(|row|) / 448 (floored as the format's reference)."""
    return (a.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)


def gemv_config(kind: str, config: tuple | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, split) for experts of `kind` ("dense", "fp8", "int8", "int4", "nvfp4"): config,
    else the Tuning in force."""
    block_n, block_k, warps, split = config or tuning.current().moe_gemv_config[kind]
    if min(block_n, block_k, warps, split) < 1:
        raise ValueError(f"moe gemv config {(block_n, block_k, warps, split)}: every value must be positive")
    return block_n, block_k, warps, split


def launch_gemv(kernel_fn, args: tuple, num_pairs: int, n: int, kdim: int, dtype, device, config, **meta):
    """Runs kernel_fn over (pairs, column blocks, splits); -> [num_pairs, n] in dtype. The kernel stores its
    program's rows at out + split * split_stride + pair * n + col (fp32 partials when split > 1)."""
    block_n, block_k, warps, split = config
    k_split = cdiv(cdiv(kdim, block_k), split) * block_k  # K per split, whole BLOCK_K steps
    split = cdiv(kdim, k_split)
    out = torch.empty(split, num_pairs, n, dtype=dtype if split == 1 else torch.float32, device=device)
    kernel_fn[(num_pairs, cdiv(n, block_n), split)](*args, out, n, kdim, k_split, num_pairs * n, BLOCK_N=block_n,
                                                    BLOCK_K=block_k, num_warps=warps, **meta)
    return out[0] if split == 1 else out.sum(0).to(dtype)


def expert_gemv(a, w, ids, a_row_div: int, w_scale=None, a_scale=None, config=None) -> torch.Tensor:
    """16-bit (w in a's dtype) or FP8 experts (w float8_e4m3fn [E, N, K], w_scale [E, N], a_scale [E], or None:
    per-token scales of a's rows). config: gemv_config's."""
    num_pairs, (_, n, kdim) = ids.numel(), w.shape
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("expert_gemv: a and w need unit stride along K")
    fp8, per_token = w_scale is not None, w_scale is not None and a_scale is None
    if per_token:
        a_scale = token_scales(a)
    w_scale, a_scale = (w_scale.float().contiguous(), a_scale.float().contiguous()) if fp8 else (w, w)
    args = (a, w, ids.reshape(-1).contiguous(), w_scale, a_scale, a.stride(0), w.stride(0), w.stride(1))
    return launch_gemv(_gemv_kernel, args, num_pairs, n, kdim, a.dtype, a.device,
                       gemv_config("fp8" if fp8 else "dense", config), A_ROW_DIV=a_row_div, FP8=fp8,
                       PER_TOKEN=per_token)


def expert_gemv_int8(a, w, w_scale, a_scale, smooth, ids, a_row_div: int, config=None) -> torch.Tensor:
    """INT8 experts: w int8 [E, N, K], w_scale [E, N], a_scale [E], smooth [E, K] (moe/int8.py's layout)."""
    w_scale, a_scale, smooth = check_int8(a, w, w_scale, a_scale, smooth, "expert_gemv_int8")
    args = (a, w, ids.reshape(-1).contiguous(), w_scale, a_scale, smooth, a.stride(0))
    return launch_gemv(_gemv_int8_kernel, args, ids.numel(), w.shape[1], w.shape[2], a.dtype, a.device,
                       gemv_config("int8", config), A_ROW_DIV=a_row_div)


def int4_block_k(group: int, want: int) -> int:
    """The INT4 GEMV's K step: the largest power of two up to `want` that divides the group (one scale per step)."""
    block_k = 1 << (max(want, 1).bit_length() - 1)
    while group % block_k:
        block_k //= 2
    return block_k


def expert_gemv_int4(a, w, scale, smooth, ids, a_row_div: int, config=None) -> torch.Tensor:
    """INT4 experts: w uint8 [E, N/2, K], scale fp32 [E, N, K / group], smooth [E, K] (moe/int4.py's layout).
    BLOCK_N counts output columns (BLOCK_N / 2 byte rows); BLOCK_K is cut to divide the group."""
    _, half, kdim = w.shape
    group = int4_group(w, scale)
    block_n, block_k, warps, split = gemv_config("int4", config)
    scale, smooth, w = scale.float().contiguous(), smooth.float().contiguous(), w.contiguous()
    args = (a, w, scale, smooth, ids.reshape(-1).contiguous(), a.stride(0))
    return launch_gemv(_gemv_int4_kernel, args, ids.numel(), 2 * half, kdim, a.dtype, a.device,
                       (max(block_n, 2), int4_block_k(group, block_k), warps, split), A_ROW_DIV=a_row_div,
                       GROUP=group)


@kernel
def _gemv_kernel(a_ptr, w_ptr, ids_ptr, w_scale_ptr, a_scale_ptr, stride_am, stride_we, stride_wn, out_ptr, N, K,
                 K_SPLIT, stride_os, A_ROW_DIV: tl.constexpr, FP8: tl.constexpr, PER_TOKEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair, split = tl.program_id(0), tl.program_id(2)
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
    k_begin = split * K_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:  # the expert's static input scale (or the row's), as the grouped GEMM
            a = tl.minimum(tl.maximum(tl.div_rn(a, a_scale), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        b = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[None, :], axis=1)
    if FP8:
        acc = acc * a_scale * tl.load(w_scale_ptr + expert * N + cols, mask=col_ok, other=0.0)
    out = out_ptr + split.to(tl.int64) * stride_os + pair.to(tl.int64) * N + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@kernel
def _gemv_int8_kernel(a_ptr, w_ptr, ids_ptr, ws_ptr, as_ptr, smooth_ptr, stride_am, out_ptr, N, K, K_SPLIT, stride_os,
                      A_ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair, split = tl.program_id(0), tl.program_id(2)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wait_for_producers(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert * N * K + cols[:, None].to(tl.int64) * K
    a_scale = tl.load(as_ptr + expert)
    acc = tl.zeros((BLOCK_N,), dtype=tl.int32)  # exact: |q w| <= 128 * 127
    k_begin = split * K_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_row + ks, mask=k_ok, other=0.0)
        q = quantize_int8(a, tl.load(smooth_ptr + expert * K + ks, mask=k_ok, other=0.0), a_scale)
        b = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        acc += tl.sum(b.to(tl.int32) * q.to(tl.int32)[None, :], axis=1)
    y = acc.to(tl.float32) * a_scale * tl.load(ws_ptr + expert * N + cols, mask=col_ok, other=0.0)
    out = out_ptr + split.to(tl.int64) * stride_os + pair.to(tl.int64) * N + cols
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=col_ok)


@kernel
def _gemv_int4_kernel(a_ptr, w_ptr, s_ptr, smooth_ptr, ids_ptr, stride_am, out_ptr, N, K, K_SPLIT, stride_os,
                      A_ROW_DIV: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    HALF_N = N // 2
    pair, split = tl.program_id(0), tl.program_id(2)
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
    k_begin = split * K_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):  # K: whole groups, GROUP: whole BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_row + ks)
        a = (a * tl.load(smooth_ptr + expert * K + ks).to(a.dtype)).to(a_ptr.dtype.element_ty).to(tl.float32)
        lo, hi = int4_nibbles(tl.load(w_rows + ks[None, :], mask=b_ok[:, None], other=0).to(tl.int32))
        g = k0 // GROUP
        acc_lo += tl.sum(lo.to(tl.float32) * a[None, :], axis=1) * tl.load(s_even + g, mask=b_ok, other=0.0)
        acc_hi += tl.sum(hi.to(tl.float32) * a[None, :], axis=1) * tl.load(s_even + groups + g, mask=b_ok, other=0.0)
    out = out_ptr + split.to(tl.int64) * stride_os + pair.to(tl.int64) * N + 2 * brow
    tl.store(out, acc_lo.to(out_ptr.dtype.element_ty), mask=b_ok)
    tl.store(out + 1, acc_hi.to(out_ptr.dtype.element_ty), mask=b_ok)
