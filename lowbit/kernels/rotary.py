"""Rotary position embedding, NeoX / HF-Llama style (rotate halves), over the whole head.

q [T, Hq, D] or [T, Hq*D], k [T, Hk, D] or [T, Hk*D]; positions [T] int; cos_sin_cache [max_pos, D] holding
cos in [:, :D/2] and sin in [:, D/2:]. Returns new (q, k) of the input shapes and dtypes.
rotary_qk reads q and k straight from the fused QKV projection's output (one launch, no copies) and returns
(q, k, v); with part_scales (fp32 [3], a merged q/k/v layer's deferred weight-scale ratios) q, k and v are first
multiplied by them in fp32 (rotation is linear) and v is written by the same launch, else v is a view of qkv.
The engine's Llama path runs rotary_kv.rotary_store_kv instead (rotary and the K/V store in one launch); rotary_qk_ref
is its reference's first half.
"""
import torch

from lowbit.kernels._triton import kernel, next_pow2, on_gpu, tl


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None):
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    if scale is not None:
        x1, x2 = x1 * scale, x2 * scale
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_ref(q, k, positions, cos_sin_cache, q_scale=None, k_scale=None):
    """q_scale, k_scale: fp32 factors applied before rotating (rotary_qk_ref's part scales)."""
    head_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    t = positions.shape[0]
    q_out = _rotate_ref(q.reshape(t, -1, head_dim), cos, sin, q_scale).reshape(q.shape)
    k_out = _rotate_ref(k.reshape(t, -1, head_dim), cos, sin, k_scale).reshape(k.shape)
    return q_out, k_out


def rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales=None):
    """qkv [T, >= (Hq+2Hk)*D] holding q's heads, k's, then v's at the start of each row -> new q [T, Hq*D],
    k [T, Hk*D], and v [T, Hk*D] (a view of qkv without part_scales)."""
    d = cos_sin_cache.shape[-1]
    q_end, k_end = num_q_heads * d, (num_q_heads + num_k_heads) * d
    q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:k_end + num_k_heads * d]
    if part_scales is None:
        return (*rotary_ref(q, k, positions, cos_sin_cache), v)
    s = part_scales.float()
    q_out, k_out = rotary_ref(q, k, positions, cos_sin_cache, s[0], s[1])
    return q_out, k_out, (v.float() * s[2]).to(qkv.dtype)


@kernel
def _rotary_kernel(x_ptr, q_out_ptr, k_out_ptr, v_out_ptr, scale_ptr, pos_ptr, cache_ptr, x_stride, HQ, HK, HV, HALF,
                   SCALED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row t of x: heads 0..HQ-1 go rotated to q_out, the next HK rotated to k_out, the next HV as they are to v_out
    (each [T, H, 2*HALF] contiguous); with SCALED, part p's heads (q, k, v) are first multiplied by scale_ptr[p]."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * 2 * HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    in_offs = t * x_stride + h[:, None] * 2 * HALF + d[None, :]
    mask = (h[:, None] < HQ + HK + HV) & d_mask[None, :]
    x1 = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + in_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        part = (h >= HQ).to(tl.int32) + (h >= HQ + HK).to(tl.int32)
        s = tl.load(scale_ptr + part).to(tl.float32)[:, None]
        x1, x2 = x1 * s, x2 * s
    is_q = h[:, None] < HQ
    is_v = h[:, None] >= HQ + HK
    dtype = q_out_ptr.dtype.element_ty
    y1 = tl.where(is_v, x1, x1 * cos - x2 * sin).to(dtype)
    y2 = tl.where(is_v, x2, x2 * cos + x1 * sin).to(dtype)
    q_offs = t * HQ * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
    k_offs = t * HK * 2 * HALF + (h[:, None] - HQ) * 2 * HALF + d[None, :]
    v_offs = t * HV * 2 * HALF + (h[:, None] - HQ - HK) * 2 * HALF + d[None, :]
    is_k = ~is_q & ~is_v
    tl.store(q_out_ptr + q_offs, y1, mask=mask & is_q)
    tl.store(q_out_ptr + q_offs + HALF, y2, mask=mask & is_q)
    tl.store(k_out_ptr + k_offs, y1, mask=mask & is_k)
    tl.store(k_out_ptr + k_offs + HALF, y2, mask=mask & is_k)
    tl.store(v_out_ptr + v_offs, y1, mask=mask & is_v)
    tl.store(v_out_ptr + v_offs + HALF, y2, mask=mask & is_v)


def _launch(x, hq, hk, positions, cache, part_scales=None):
    """x [T, >= (hq+hk)*D] (>= (hq+2hk)*D with part_scales) with unit stride along a row -> q [T, hq*D],
    k [T, hk*D] and, with part_scales (fp32 [3]), v [T, hk*D], in one launch."""
    t, head_dim = positions.shape[0], cache.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    hv = hk if part_scales is not None else 0
    q_out = torch.empty(t, hq * head_dim, dtype=x.dtype, device=x.device)
    k_out = torch.empty(t, hk * head_dim, dtype=x.dtype, device=x.device) if hk else q_out
    v_out = torch.empty(t, hv * head_dim, dtype=x.dtype, device=x.device) if hv else q_out
    if part_scales is not None and (part_scales.numel() != 3 or part_scales.dtype != torch.float32):
        raise ValueError(f"part_scales must be float32 [3], got {part_scales.dtype} {tuple(part_scales.shape)}")
    half = head_dim // 2
    _rotary_kernel[(t,)](x, q_out, k_out, v_out, part_scales if part_scales is not None else cache, positions, cache,
                         x.stride(0), hq, hk, hv, half, SCALED=part_scales is not None,
                         BLOCK_H=next_pow2(hq + hk + hv), BLOCK_D=next_pow2(half), num_warps=4)
    return q_out, k_out, v_out


def rotary(q, k, positions, cos_sin_cache):
    if not on_gpu(q):
        return rotary_ref(q, k, positions, cos_sin_cache)
    return rotary_triton(q, k, positions, cos_sin_cache)


def rotary_triton(q, k, positions, cos_sin_cache):
    cache, t, d = cos_sin_cache.contiguous(), positions.shape[0], cos_sin_cache.shape[-1]
    q_out, _, _ = _launch(q.reshape(t, -1), q.numel() // (t * d), 0, positions, cache)
    k_out, _, _ = _launch(k.reshape(t, -1), k.numel() // (t * d), 0, positions, cache)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)


def rotary_qk(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales=None):
    """One launch for q and k (and v, with part_scales) read from the fused QKV output (rows may be strided):
    see rotary_qk_ref."""
    if not on_gpu(qkv):
        return rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales)
    return rotary_qk_triton(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales)


def rotary_qk_triton(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales=None):
    q, k, v = _launch(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache.contiguous(), part_scales)
    if part_scales is None:
        d = cos_sin_cache.shape[-1]
        v = qkv[:, (num_q_heads + num_k_heads) * d:(num_q_heads + 2 * num_k_heads) * d]
    return q, k, v
