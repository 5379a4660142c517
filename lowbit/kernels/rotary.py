"""Rotary position embedding, NeoX / HF-Llama style (rotate halves), over the whole head.

q [T, Hq, D] or [T, Hq*D], k [T, Hk, D] or [T, Hk*D]; positions [T] int; cos_sin_cache [max_pos, D] holding
cos in [:, :D/2] and sin in [:, D/2:]. Returns new (q, k) of the input shapes and dtypes.
rotary_qk reads q and k straight from the fused QKV projection's output (one launch, no copies).
"""
import torch

from lowbit.kernels._triton import kernel, next_pow2, on_gpu, tl


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_ref(q, k, positions, cos_sin_cache):
    head_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    t = positions.shape[0]
    q_out = _rotate_ref(q.reshape(t, -1, head_dim), cos, sin).reshape(q.shape)
    k_out = _rotate_ref(k.reshape(t, -1, head_dim), cos, sin).reshape(k.shape)
    return q_out, k_out


def rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache):
    """qkv [T, >= (Hq+Hk)*D] holding q's heads then k's at the start of each row -> new q [T, Hq*D], k [T, Hk*D]."""
    q_cols, k_cols = num_q_heads * cos_sin_cache.shape[-1], num_k_heads * cos_sin_cache.shape[-1]
    return rotary_ref(qkv[:, :q_cols], qkv[:, q_cols:q_cols + k_cols], positions, cos_sin_cache)


@kernel
def _rotary_kernel(x_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, x_stride, HQ, HK, HALF,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row t of x: heads 0..HQ-1 go to q_out, heads HQ..HQ+HK-1 to k_out (both [T, H, 2*HALF] contiguous)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * 2 * HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    in_offs = t * x_stride + h[:, None] * 2 * HALF + d[None, :]
    mask = (h[:, None] < HQ + HK) & d_mask[None, :]
    x1 = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + in_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    y1, y2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
    is_q = h[:, None] < HQ
    q_offs = t * HQ * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
    k_offs = t * HK * 2 * HALF + (h[:, None] - HQ) * 2 * HALF + d[None, :]
    tl.store(q_out_ptr + q_offs, y1, mask=mask & is_q)
    tl.store(q_out_ptr + q_offs + HALF, y2, mask=mask & is_q)
    tl.store(k_out_ptr + k_offs, y1, mask=mask & ~is_q)
    tl.store(k_out_ptr + k_offs + HALF, y2, mask=mask & ~is_q)


def _launch(x, hq, hk, positions, cache):
    """x [T, >= (hq+hk)*D] with unit stride along a row -> (q [T, hq*D], k [T, hk*D]) in one launch."""
    t, head_dim = positions.shape[0], cache.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    q_out = torch.empty(t, hq * head_dim, dtype=x.dtype, device=x.device)
    k_out = torch.empty(t, hk * head_dim, dtype=x.dtype, device=x.device) if hk else q_out
    half = head_dim // 2
    _rotary_kernel[(t,)](x, q_out, k_out, positions, cache, x.stride(0), hq, hk, half,
                         BLOCK_H=next_pow2(hq + hk), BLOCK_D=next_pow2(half), num_warps=4)
    return q_out, k_out


def rotary(q, k, positions, cos_sin_cache):
    if not on_gpu(q):
        return rotary_ref(q, k, positions, cos_sin_cache)
    return rotary_triton(q, k, positions, cos_sin_cache)


def rotary_triton(q, k, positions, cos_sin_cache):
    cache, t, d = cos_sin_cache.contiguous(), positions.shape[0], cos_sin_cache.shape[-1]
    q_out, _ = _launch(q.reshape(t, -1), q.numel() // (t * d), 0, positions, cache)
    k_out, _ = _launch(k.reshape(t, -1), k.numel() // (t * d), 0, positions, cache)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)


def rotary_qk(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache):
    """One launch for q and k read from the fused QKV output (rows may be strided): see rotary_qk_ref."""
    if not on_gpu(qkv):
        return rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache)
    return rotary_qk_triton(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache)


def rotary_qk_triton(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache):
    return _launch(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache.contiguous())
