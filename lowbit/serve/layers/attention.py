"""Paged attention over one KV tensor per layer, behind a backend of three functions (store K/V; rotate q and k from
the fused QKV rows and store K/V, in one; attend).

kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], in the model dtype or float8_e4m3fn. With FP8, the
stored value is k / k_scale (v / v_scale), the checkpoint's per-layer scalars, and V is stored transposed within
each block (lowbit.kernels' paged attention). The torch reference below runs
everywhere; a GPU backend (layers.triton_attention) replaces it by implementing the same three functions.
"""
import torch
import torch.nn.functional as F
from torch import nn

from lowbit.kernels import gather_kv, quantize_fp8_ref, rotary_qk_ref, store_kv_ref
from lowbit.serve.runner.context import StepContext


class TorchAttentionBackend:
    """Reference: scatter K/V into slots, then per sequence gather its blocks and run SDPA with a causal offset."""

    @staticmethod
    def store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale) -> None:
        """k, v [T, Hk, D] -> the cache at slot // block_size, slot % block_size (slots < 0 skipped)."""
        store_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def rotary_store_kv(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales, kv_cache,
                        slot_mapping, k_scale, v_scale) -> torch.Tensor:
        """qkv [T, >= (Hq+2Hk)*D], the fused projection's rows -> rotated q [T, Hq*D]; rotated k and v stored as
        store_kv stores them (rotary_qk_ref, then store_kv)."""
        q, k, v = rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales)
        t, d = q.shape[0], cos_sin_cache.shape[-1]
        TorchAttentionBackend.store_kv(k.view(t, num_k_heads, d), v.reshape(t, num_k_heads, d), kv_cache,
                                       slot_mapping, k_scale, v_scale)
        return q

    @staticmethod
    def attend(q, kv_cache, ctx: StepContext, scale: float, k_scale, v_scale, out_scale=None) -> torch.Tensor:
        """q [T, Hq, D] -> out [T, Hq, D]: each new token attends to its sequence's keys up to its own position.
        out_scale: the output (in q's dtype) quantized to float8_e4m3fn with this static scale."""
        out = torch.empty_like(q)
        start = 0
        for b, (n, ctx_len) in enumerate(zip(ctx.query_lens_cpu, ctx.context_lens_cpu)):
            k, v = gather_kv(kv_cache, ctx.block_tables[b], ctx_len, k_scale, v_scale, q.dtype)
            qb = q[start:start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
            mask = None  # a whole prompt at once: is_causal; a later chunk: query i sits at ctx_len - n + i
            if 1 < n < ctx_len:
                mask = torch.ones(n, ctx_len, dtype=torch.bool, device=q.device).tril(ctx_len - n)
            k, v = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()  # [1, Hk, ctx, D]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask,
                                               is_causal=1 < n == ctx_len, scale=scale, enable_gqa=True)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out if out_scale is None else quantize_fp8_ref(out, out_scale)


_backend = TorchAttentionBackend()


def set_attention_backend(backend) -> None:
    """Install a backend with store_kv / rotary_store_kv / attend of the signatures above (e.g. Triton kernels on
    the GPU)."""
    global _backend
    _backend = backend


class Attention(nn.Module):
    """Stores this step's K/V into the layer's cache, then attends over the cache (including them)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.kv_cache: torch.Tensor | None = None  # assigned by the ModelRunner
        self.k_scale = torch.tensor(1.0)  # float32 scalars, used only with an FP8 cache
        self.v_scale = torch.tensor(1.0)

    def forward(self, q, k, v, ctx: StepContext, out_scale=None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hk*D] -> [T, Hq*D] (float8_e4m3fn, out / out_scale, when out_scale is given)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        _backend.store_kv(k, v, self.kv_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q, ctx, out_scale)

    def forward_qkv(self, qkv, cos_sin_cache, part_scales, ctx: StepContext, out_scale=None) -> torch.Tensor:
        """qkv [T, >= (Hq+2Hk)*D], the fused projection's rows (part_scales: fp32 [3] or None, see rotary_qk_ref) ->
        [T, Hq*D] as forward gives: rotary and the K/V store in one backend call."""
        q = _backend.rotary_store_kv(qkv, self.num_heads, self.num_kv_heads, ctx.positions, cos_sin_cache,
                                     part_scales, self.kv_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q.view(q.shape[0], self.num_heads, self.head_dim), ctx, out_scale)

    def _attend(self, q, ctx: StepContext, out_scale) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq*D]."""
        out = _backend.attend(q, self.kv_cache, ctx, self.scale, self.k_scale, self.v_scale, out_scale)
        return out.reshape(q.shape[0], -1)
