"""Rotary position embedding, NeoX / HF-Llama style (rotate halves), over the whole head.

q [T, Hq, D] or [T, Hq*D], k [T, Hk, D] or [T, Hk*D]; positions [T] int; cos_sin_cache [max_pos, D] holding
cos in [:, :D/2] and sin in [:, D/2:]. Returns new (q, k) of the input shapes and dtypes.
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


@kernel
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cache_ptr, H, HALF,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * 2 * HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    offs = t * H * 2 * HALF + h[:, None] * 2 * HALF + d[None, :]
    mask = (h[:, None] < H) & d_mask[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_ptr + offs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _rotate(x, positions, cache):
    t, head_dim = positions.shape[0], cache.shape[-1]
    x3 = x.reshape(t, -1, head_dim).contiguous()
    out = torch.empty_like(x3)
    half = head_dim // 2
    _rotary_kernel[(t,)](x3, out, positions, cache, x3.shape[1], half,
                         BLOCK_H=next_pow2(x3.shape[1]), BLOCK_D=next_pow2(half), num_warps=4)
    return out.reshape(x.shape)


def rotary(q, k, positions, cos_sin_cache):
    if not on_gpu(q):
        return rotary_ref(q, k, positions, cos_sin_cache)
    return rotary_triton(q, k, positions, cos_sin_cache)


def rotary_triton(q, k, positions, cos_sin_cache):
    cache = cos_sin_cache.contiguous()
    return _rotate(q, positions, cache), _rotate(k, positions, cache)
