"""Rotary fused into the paged KV store: one launch reads the fused QKV rows, returns rotated q and writes rotated k
and v into the cache, instead of a rotary launch followed by store_kv's.

qkv [T, >= (Hq+2Hk)*D] (q's heads, k's, then v's at the start of each row; rows may be strided); positions [T];
cos_sin_cache [max_pos, D]; part_scales fp32 [3] or None (see rotary_qk_ref); kv_cache [2, blocks, block_size, Hk, D]
in the model dtype or float8_e4m3fn (k / k_scale, v / v_scale; V transposed within each block, as
lowbit.kernels.attention.paged_attention lays FP8 caches out); slot_mapping [T], slots < 0 skipped.
The stored values are rounded as store_kv_ref(rotary_qk_ref(...)) rounds them: k rotated and rounded to the model
dtype first, then (FP8) / k_scale in fp32 (as a product with 1 / k_scale: one fp32 rounding apart), clamped to
+-448, cast. Launchers read device tensors only (CUDA graphs).

qk_norm (q_weight [D], k_weight [D], eps), Qwen3's and Gemma 3's per-head RMSNorm before RoPE: every q and k head is
normed first, rounded as lowbit.kernels.rms_norm_ref rounds (the normalized head, then times the weight, each to the
model dtype); it takes no part_scales (a norm would absorb a part's scale).
"""
import torch

from lowbit.kernels._triton import cdiv, kernel, next_pow2, tl, wait_for_producers
from lowbit.kernels.attention.paged_attention import _scale_tensor, _v_offset, store_kv_ref
from lowbit.kernels.ops.norm import rms_norm_ref
from lowbit.kernels.ops.rotary import rotary_qk_ref


def qk_norm_ref(qkv: torch.Tensor, num_q_heads: int, num_k_heads: int, head_dim: int, qk_norm) -> torch.Tensor:
    """qkv rows -> [T, (Hq+2Hk)*D] with each q and k head RMS-normed (rms_norm_ref), v as it is."""
    q_weight, k_weight, eps = qk_norm
    t, q_end, k_end = qkv.shape[0], num_q_heads * head_dim, (num_q_heads + num_k_heads) * head_dim
    q, k = qkv[:, :q_end].reshape(t, -1, head_dim), qkv[:, q_end:k_end].reshape(t, -1, head_dim)
    q, k = rms_norm_ref(q, q_weight, eps)[0], rms_norm_ref(k, k_weight, eps)[0]
    return torch.cat([q.reshape(t, -1), k.reshape(t, -1),
                      qkv[:, k_end:k_end + num_k_heads * head_dim]], dim=1)


def rotary_store_kv_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales, kv_cache,
                        slot_mapping, k_scale, v_scale, qk_norm=None) -> torch.Tensor:
    """-> rotated q [T, Hq*D]; rotated k and v stored into kv_cache at slot_mapping."""
    if qk_norm is not None:
        qkv = qk_norm_ref(qkv, num_q_heads, num_k_heads, cos_sin_cache.shape[-1], qk_norm)
    q, k, v = rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales)
    t, d = q.shape[0], cos_sin_cache.shape[-1]
    store_kv_ref(k.view(t, num_k_heads, d), v.reshape(t, num_k_heads, d), kv_cache, slot_mapping, k_scale, v_scale)
    return q


@kernel
def _rotary_store_kv_kernel(x_ptr, q_ptr, kv_ptr, slot_ptr, pos_ptr, cs_ptr, ps_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr,
                            eps, x_stride, half_stride, HQ, HK, HALF, BS: tl.constexpr, SCALED: tl.constexpr,
                            FP8: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                            PDL: tl.constexpr):
    """Row t of x, heads BLOCK_H * program_id(1) and on: heads [0, HQ) rotated to q [T, HQ, 2*HALF]; heads
    [HQ, HQ+HK) rotated and [HQ+HK, HQ+2HK) as they are to kv_cache half 0 and 1 at slot t; with SCALED, part p's
    heads first multiplied by ps_ptr[p]; with NORM, q's and k's heads first RMS-normed (weights qw_ptr, kw_ptr
    [2*HALF]; a program holds whole heads). Positions, slots, the cos / sin rows and the scales are loaded before the
    PDL wait (no kernel of a step writes them: lowbit.kernels.attention.paged_attention's decode does the same); x
    after it."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * 2 * HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    mask = (h < HQ + 2 * HK) & d_mask
    is_q = h < HQ
    is_v = h >= HQ + HK
    if SCALED:
        part = (h >= HQ).to(tl.int32) + (h >= HQ + HK).to(tl.int32)
        s = tl.load(ps_ptr + part).to(tl.float32)
    if FP8:  # one division per program (k and v), not per element
        inv = tl.where(is_v, tl.div_rn(1.0, tl.load(vs_ptr)), tl.div_rn(1.0, tl.load(ks_ptr)))
    if NORM:  # each row's head weights, both halves: q's for q heads, k's for the rest (v's unused)
        w1 = tl.where(is_q, tl.load(qw_ptr + d, mask=d_mask, other=0.0), tl.load(kw_ptr + d, mask=d_mask, other=0.0))
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d, mask=d_mask, other=0.0),
                      tl.load(kw_ptr + HALF + d, mask=d_mask, other=0.0))
    wait_for_producers(PDL)
    in_offs = t * x_stride + h * 2 * HALF + d
    x1 = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + in_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x1, x2 = x1 * s, x2 * s
    if NORM:  # rms_norm_ref's roundings: the normalized head, then times the weight, each to the model dtype
        dtype = q_ptr.dtype.element_ty
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        n1 = (w1.to(tl.float32) * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        n2 = (w2.to(tl.float32) * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x1, x2 = tl.where(is_v, x1, n1), tl.where(is_v, x2, n2)
    y1 = tl.where(is_v, x1, x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)  # rounded to the model dtype
    y2 = tl.where(is_v, x2, x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    q_offs = t * HQ * 2 * HALF + h * 2 * HALF + d
    tl.store(q_ptr + q_offs, y1, mask=mask & is_q)
    tl.store(q_ptr + q_offs + HALF, y2, mask=mask & is_q)
    if slot >= 0:  # a padded row (CUDA-graph batch padding) stores nothing
        kv_head = tl.where(is_v, h - HQ - HK, h - HQ)
        dst = kv_ptr + tl.where(is_v, half_stride, 0) + slot * HK * 2 * HALF + kv_head * 2 * HALF + d
        if FP8:
            c1 = tl.minimum(tl.maximum(y1.to(tl.float32) * inv, -448.0), 448.0).to(tl.float8e4nv)
            c2 = tl.minimum(tl.maximum(y2.to(tl.float32) * inv, -448.0), 448.0).to(tl.float8e4nv)
            # V transposed within its block (paged_attention's module docstring): dims HALF apart are HALF * BS apart
            v_dst = kv_ptr + half_stride + _v_offset(slot, kv_head * 2 * HALF + d, HK * 2 * HALF, BS)
            dst = tl.where(is_v, v_dst, dst)
            step = tl.where(is_v, HALF * BS, HALF)
            tl.store(dst, c1, mask=mask & ~is_q)
            tl.store(dst + step, c2, mask=mask & ~is_q)
        else:
            tl.store(dst, y1, mask=mask & ~is_q)
            tl.store(dst + HALF, y2, mask=mask & ~is_q)


def rotary_store_kv(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales, kv_cache, slot_mapping,
                    k_scale, v_scale, qk_norm=None) -> torch.Tensor:
    """Triton, one launch: same contract as rotary_store_kv_ref."""
    t, d = positions.shape[0], cos_sin_cache.shape[-1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if part_scales is not None and (part_scales.numel() != 3 or part_scales.dtype != torch.float32):
        raise ValueError(f"part_scales must be float32 [3], got {part_scales.dtype} {tuple(part_scales.shape)}")
    if kv_cache.shape[-2:] != (num_k_heads, d) or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous [2, blocks, block_size, {num_k_heads}, {d}]")
    if qk_norm is not None and part_scales is not None:
        raise ValueError("rotary_store_kv: qk_norm takes no part_scales")
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos_sin_cache, cos_sin_cache, 0.0)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    ks, vs = (_scale_tensor(k_scale, qkv.device), _scale_tensor(v_scale, qkv.device)) if fp8 else (qkv, qkv)
    q = torch.empty(t, num_q_heads * d, dtype=qkv.dtype, device=qkv.device)
    cache = cos_sin_cache.contiguous()
    heads = num_q_heads + 2 * num_k_heads
    block_h = min(16, next_pow2(heads))  # Llama-3.1-8B: 48 heads in 3 programs per token (batch 1: 3 SMs, not 1)
    _rotary_store_kv_kernel[(t, cdiv(heads, block_h))](qkv, q, kv_cache, slot_mapping, positions, cache,
                                  part_scales if part_scales is not None else cache, ks, vs, q_weight, k_weight,
                                  float(eps), qkv.stride(0), kv_cache.stride(0), num_q_heads, num_k_heads, d // 2,
                                  BS=kv_cache.shape[2], SCALED=part_scales is not None, FP8=fp8,
                                  NORM=qk_norm is not None,
                                  BLOCK_H=block_h, BLOCK_D=next_pow2(d // 2), num_warps=4)
    return q
