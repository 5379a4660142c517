"""Rotary position embedding, NeoX / HF-Llama style (rotate halves), over the whole head.

q [T, Hq, D] or [T, Hq*D], k [T, Hk, D] or [T, Hk*D]; positions [T] int; cos_sin_cache [max_pos, D] holding
cos in [:, :D/2] and sin in [:, D/2:]. Returns new (q, k) of the input shapes and dtypes.
rotary (Qwen3's path, after its q/k norms) rotates q and k given apart. rotary_qk_ref reads q, k and v straight from
the fused QKV projection's rows, with part_scales (fp32 [3], a merged q/k/v layer's deferred weight-scale ratios)
multiplying q, k and v in fp32 first (rotation is linear): the first half of the reference of
rotary_kv.rotary_store_kv, which the Llama path runs (rotary and the K/V store in one launch).
"""
import torch

from lowbit.kernels._triton import kernel, next_pow2, on_gpu, tl, wait_for_producers


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
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cache_ptr, x_stride, H, HALF, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Row t of x: its H heads rotated into out [T, H, 2*HALF] (contiguous). The position and its cos / sin rows are
    loaded before the PDL wait (step inputs and a constant cache), x after it."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * 2 * HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    wait_for_producers(PDL)
    in_offs = t * x_stride + h[:, None] * 2 * HALF + d[None, :]
    mask = (h[:, None] < H) & d_mask[None, :]
    x1 = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + in_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out_offs = t * H * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
    tl.store(out_ptr + out_offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_ptr + out_offs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _launch(x, heads, positions, cache):
    """x [T, >= heads*D] with unit stride along a row -> its first `heads` heads rotated, [T, heads*D]."""
    t, head_dim = positions.shape[0], cache.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(t, heads * head_dim, dtype=x.dtype, device=x.device)
    half = head_dim // 2
    _rotary_kernel[(t,)](x, out, positions, cache, x.stride(0), heads, half, BLOCK_H=next_pow2(heads),
                         BLOCK_D=next_pow2(half), num_warps=4)
    return out


def rotary(q, k, positions, cos_sin_cache):
    if not on_gpu(q):
        return rotary_ref(q, k, positions, cos_sin_cache)
    return rotary_triton(q, k, positions, cos_sin_cache)


def rotary_triton(q, k, positions, cos_sin_cache):
    cache, t, d = cos_sin_cache.contiguous(), positions.shape[0], cos_sin_cache.shape[-1]
    q_out = _launch(q.reshape(t, -1), q.numel() // (t * d), positions, cache)
    k_out = _launch(k.reshape(t, -1), k.numel() // (t * d), positions, cache)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)
