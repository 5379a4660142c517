"""Experiment, not shipped (it lost to the unfused path: dev/notes/wave2.md, eighth session): the fused MoE's decode
path for 16-bit and FP8 experts in two launches instead of four.

gated_gemv: one program per (pair, BLOCK_N columns of the intermediate), reading its expert's gate rows and the
matching up rows against the pair's x row: act[i] = silu(gate) * up, [num_pairs, I] in x's dtype.
down_combine_gemv: one program per (token, BLOCK_N hidden columns), looping over the token's top_k slots: out[t] =
sum_j topk_weights[t, j] * (act[t * k + j] @ w2[expert]^T), [T, H].

Rounding as lowbit's unfused path (moe.gemv, the activation kernel, the combine). tiles: (BLOCK_N, BLOCK_K, warps).
"""
import torch

from lowbit.kernels._triton import cdiv, kernel, tl, wait_for_producers
from lowbit.kernels.moe.gemv import token_scales


def _scales(a, w_scale, a_scale):
    """-> (fp8, per_token, w_scale, a_scale) as the kernels take them (unused pointers: a)."""
    fp8, per_token = w_scale is not None, w_scale is not None and a_scale is None
    if per_token:
        a_scale = token_scales(a)
    if not fp8:
        return False, False, a, a
    return True, per_token, w_scale.float().contiguous(), a_scale.float().contiguous()


def gated_gemv(x, w13, ids, w_scale, a_scale, tiles) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (x's dtype with w_scale None, or float8_e4m3fn with w_scale [E, 2I] and a_scale [E] or
    None: per token), ids [T, k] -> silu(gate) * up per pair, [T * k, I] in x's dtype."""
    t, top_k = ids.shape
    _, two_i, kdim = w13.shape
    if x.stride(-1) != 1 or w13.stride(-1) != 1:
        raise ValueError("gated_gemv: x and w13 need unit stride along K")
    block_n, block_k, warps = tiles
    fp8, per_token, w_scale, a_scale = _scales(x, w_scale, a_scale)
    inter = two_i // 2
    out = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    _gated_gemv_kernel[(t * top_k, cdiv(inter, block_n))](
        x, w13, ids.reshape(-1).contiguous(), w_scale, a_scale, x.stride(0), w13.stride(0), w13.stride(1), out, inter,
        kdim, A_ROW_DIV=top_k, FP8=fp8, PER_TOKEN=per_token, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def down_combine_gemv(act, w2, ids, topk_weights, w_scale, a_scale, tiles) -> torch.Tensor:
    """act [T * k, I] (gated_gemv's), w2 [E, H, I] (scales as gated_gemv's), ids / topk_weights [T, k] -> [T, H]."""
    t, top_k = ids.shape
    _, hidden, kdim = w2.shape
    if act.stride(-1) != 1 or w2.stride(-1) != 1 or act.shape[0] != t * top_k:
        raise ValueError("down_combine_gemv: act [T * k, I] and w2 need unit stride along K")
    block_n, block_k, warps = tiles
    fp8, per_token, w_scale, a_scale = _scales(act, w_scale, a_scale)
    out = torch.empty(t, hidden, dtype=act.dtype, device=act.device)
    _down_combine_kernel[(t, cdiv(hidden, block_n))](
        act, w2, ids.reshape(-1).contiguous(), topk_weights.float().reshape(-1).contiguous(), w_scale, a_scale,
        act.stride(0), w2.stride(0), w2.stride(1), out, hidden, kdim, TOP_K=top_k, FP8=fp8, PER_TOKEN=per_token,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


@kernel
def _gated_gemv_kernel(a_ptr, w_ptr, ids_ptr, w_scale_ptr, a_scale_ptr, stride_am, stride_we, stride_wn, out_ptr, I, K,
                       A_ROW_DIV: tl.constexpr, FP8: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    wait_for_producers(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = (pair // A_ROW_DIV).to(tl.int64)
    a_row = a_ptr + row * stride_am
    gate_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + I * stride_wn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PER_TOKEN:
        a_scale = tl.load(a_scale_ptr + row)
    elif FP8:
        a_scale = tl.load(a_scale_ptr + expert)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            a = tl.minimum(tl.maximum(tl.div_rn(a, a_scale), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        w_ok = col_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(gate_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32) * a[None, :], axis=1)
        acc_u += tl.sum(tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32) * a[None, :], axis=1)
    if FP8:
        scales = w_scale_ptr + expert * 2 * I + cols
        acc_g = acc_g * a_scale * tl.load(scales, mask=col_ok, other=0.0)
        acc_u = acc_u * a_scale * tl.load(scales + I, mask=col_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * I + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=col_ok)


@kernel
def _down_combine_kernel(a_ptr, w_ptr, ids_ptr, tw_ptr, w_scale_ptr, a_scale_ptr, stride_am, stride_we, stride_wn,
                         out_ptr, N, K, TOP_K: tl.constexpr, FP8: tl.constexpr, PER_TOKEN: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wait_for_producers(PDL)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tok * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = a_ptr + pair * stride_am
        w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        if PER_TOKEN:
            a_scale = tl.load(a_scale_ptr + pair)
        elif FP8:
            a_scale = tl.load(a_scale_ptr + expert)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_row + ks, mask=k_ok, other=0.0).to(tl.float32)
            if FP8:
                a = tl.minimum(tl.maximum(tl.div_rn(a, a_scale), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
            b = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        if FP8:
            acc = acc * a_scale * tl.load(w_scale_ptr + expert * N + cols, mask=col_ok, other=0.0)
        total += tl.load(tw_ptr + pair) * acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + tok * N + cols, total.to(dtype), mask=col_ok)
