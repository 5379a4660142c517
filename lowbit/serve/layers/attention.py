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

from lowbit.kernels import (attention_ref, gather_kv, qk_norm_ref, quantize_fp8_ref, rotary_qk_ref, store_kv_ref,
                            v_blocks, window_start)
from lowbit.serve.runner.context import StepContext


class TorchAttentionBackend:
    """Reference: scatter K/V into slots, then attend with SDPA over each sequence's gathered keys (every
    sequence of a pure-decode step at once, one padded SDPA; a prompt chunk with a causal offset).

    What every layer of a step shares is computed once per step (`_StepMemo`): the rotary cos/sin rows of the
    step's positions and the cache slots each decoding sequence attends to.
    """

    @staticmethod
    def store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale) -> None:
        """k, v [T, Hk, D] -> the cache at slot // block_size, slot % block_size (slots < 0 skipped): store_kv_ref's
        writes, with the slots split into (block, offset) once a step on the CPU."""
        where = _MEMO.store_slots(slot_mapping, kv_cache.shape[2])
        if where is None:
            store_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)
            return
        blk, off = where
        for half, x, s in ((kv_cache[0], k, k_scale), (v_blocks(kv_cache), v, v_scale)):
            if half.dtype == torch.float8_e4m3fn:
                half.view(torch.uint8)[blk, off] = quantize_fp8_ref(x, s).view(torch.uint8)
            else:
                half[blk, off] = x.to(half.dtype)

    @staticmethod
    def rotary_store_kv(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales, kv_cache,
                        slot_mapping, k_scale, v_scale, qk_norm=None) -> torch.Tensor:
        """qkv [T, >= (Hq+2Hk)*D], the fused projection's rows -> rotated q [T, Hq*D]; rotated k and v stored as
        store_kv stores them (rotary_qk_ref's math, then store_kv). qk_norm: (q weight, k weight, eps) of per-head
        RMSNorms applied first (qk_norm_ref)."""
        t, d = qkv.shape[0], cos_sin_cache.shape[-1]
        if qk_norm is not None:
            qkv = qk_norm_ref(qkv, num_q_heads, num_k_heads, d, qk_norm)
        if part_scales is not None:  # deferred FP8 ratios (GPU merges only): the reference as written
            q, k, v = rotary_qk_ref(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales)
        else:  # rotary_qk_ref's elementwise math on q's and k's heads in one pass, cos/sin gathered once a step
            cos, sin = _MEMO.cos_sin(positions, cos_sin_cache)
            n = num_q_heads + 2 * num_k_heads
            heads = qkv.view(t, -1, d) if qkv.is_contiguous() and qkv.shape[1] % d == 0 else \
                qkv[:, :n * d].reshape(t, n, d)  # [T, >= Hq+2Hk, D], a view when the rows allow it
            qk = _rotate(heads[:, :num_q_heads + num_k_heads], cos, sin)
            q, k = qk[:, :num_q_heads].reshape(t, -1), qk[:, num_q_heads:]
            v = heads[:, num_q_heads + num_k_heads:num_q_heads + 2 * num_k_heads]
        TorchAttentionBackend.store_kv(k.reshape(t, num_k_heads, d), v.reshape(t, num_k_heads, d), kv_cache,
                                       slot_mapping, k_scale, v_scale)
        return q

    @staticmethod
    def attend(q, kv_cache, ctx: StepContext, scale: float, k_scale, v_scale, out_scale=None, sliding_window=None,
               logit_softcap=None) -> torch.Tensor:
        """q [T, Hq, D] -> out [T, Hq, D]: each new token attends to its sequence's keys up to its own position
        (sliding_window W: only the last W of them, its own included; logit_softcap c: scores = c * tanh(scores / c)
        before the softmax). out_scale: the output (in q's dtype) quantized to float8_e4m3fn with this static scale."""
        if ctx.is_decode:
            out = _attend_decode(q, kv_cache, ctx, scale, k_scale, v_scale, sliding_window, logit_softcap)
            return out if out_scale is None else quantize_fp8_ref(out, out_scale)
        out = torch.empty_like(q)
        start = 0
        for b, (n, ctx_len) in enumerate(zip(ctx.query_lens_cpu, ctx.context_lens_cpu)):
            first = window_start(ctx_len - n, sliding_window, kv_cache.shape[2])  # blocks before it: not read
            k, v = gather_kv(kv_cache, ctx.block_tables[b], ctx_len, k_scale, v_scale, q.dtype, first)
            qb = q[start:start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
            k, v = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()  # [1, Hk, L, D]
            if sliding_window is None and logit_softcap is None:
                mask = None  # a whole prompt at once: is_causal; a later chunk: query i sits at ctx_len - n + i
                if 1 < n < ctx_len:
                    mask = torch.ones(n, ctx_len, dtype=torch.bool, device=q.device).tril(ctx_len - n)
                o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask,
                                                   is_causal=1 < n == ctx_len, scale=scale, enable_gqa=True)
            else:
                o = attention_ref(qb, k, v, torch.arange(ctx_len - n, ctx_len, device=q.device),
                                  torch.arange(first, ctx_len, device=q.device), scale, sliding_window, logit_softcap)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out if out_scale is None else quantize_fp8_ref(out, out_scale)


def _rotate(x, cos, sin):
    """x [T, H, D] -> rotated (NeoX halves) in x's dtype, fp32 math: lowbit.kernels.rotary_ref's _rotate_ref."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _attend_decode(q, kv_cache, ctx: StepContext, scale, k_scale, v_scale, sliding_window, logit_softcap):
    """One new token per sequence: q [B, Hq, D] -> [B, Hq, D], every sequence in one SDPA over its keys gathered
    into [B, Hk, L, D] (L = the longest context, or at most W with a window; shorter ones masked)."""
    blk, off, mask = _MEMO.decode_slots(ctx, kv_cache.shape[2], sliding_window)
    kv = []
    for half, s in ((kv_cache[0], k_scale), (v_blocks(kv_cache), v_scale)):
        if half.dtype == torch.float8_e4m3fn:  # gathered as bytes (CPU indexing has no float8 kernels)
            x = (half.view(torch.uint8)[blk, off].view(half.dtype).float() * s).to(q.dtype)
        else:
            x = half[blk, off].to(q.dtype)  # [B, L, Hk, D], token order whatever the cache layout
        kv.append(x.transpose(1, 2))
    if logit_softcap is None:
        o = F.scaled_dot_product_attention(q[:, :, None], kv[0], kv[1], attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o[:, :, 0]
    g = q.shape[1] // kv[0].shape[1]  # softcapped scores: transformers' eager math in fp32
    s = (q[:, :, None].float() @ kv[0].float().repeat_interleave(g, 1).transpose(-1, -2)) * scale  # [B, Hq, 1, L]
    s = logit_softcap * torch.tanh(s / logit_softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, dim=-1) @ kv[1].float().repeat_interleave(g, 1)
    return o[:, :, 0].to(q.dtype)


class _StepMemo:
    """Per-step tensors every layer would otherwise rebuild, keyed by the identity of the step's own tensors
    (held here, so an id is not reused): each step uploads new ones (ModelRunner.device_inputs), so a stale entry
    is never hit. Static buffers rewritten in place between steps (CUDA graphs) run the Triton backend instead."""

    def __init__(self):
        self._rot_key = self._store_key = None
        self._rot = self._store = None
        self._slots: list[tuple[StepContext, dict]] = []  # the latest contexts (a step has one per KV kind)

    def store_slots(self, slot_mapping, block_size: int):
        """slot_mapping [T] on the CPU with no skipped (< 0) slot -> (block ids [T], offsets [T]); else None (the
        reference handles it: on a GPU the check would wait for the device)."""
        if slot_mapping.device.type != "cpu":
            return None
        key = (slot_mapping, block_size)
        if not _same(key, self._store_key):
            slots = slot_mapping.long()
            where = None if bool((slots < 0).any()) else (slots // block_size, slots % block_size)
            self._store_key, self._store = key, where
        return self._store

    def cos_sin(self, positions, cache):
        """positions [T], cache [max_pos, D] -> cos, sin [T, 1, D/2] fp32 (rotary_ref's rows)."""
        key = (positions, cache)
        if not _same(key, self._rot_key):
            cos, sin = cache[positions.long()].float().chunk(2, dim=-1)
            self._rot_key, self._rot = key, (cos[:, None, :], sin[:, None, :])
        return self._rot

    def decode_slots(self, ctx: StepContext, block_size: int, sliding_window: int | None = None):
        """ctx of a pure-decode step -> (block ids [B, L], offsets [B, L], mask [B, 1, 1, L] or None when every
        slot is valid): sequence b's tokens from max(0, len_b - W) (0 without a window W) on, L = the most of them
        any sequence has (past its length: its own last slot, masked). One entry per window size a step asks for."""
        slots = next((entry for c, entry in self._slots if c is ctx), None)
        if slots is None:
            slots = {}
            self._slots = [(ctx, slots)] + self._slots[:MEMO_CONTEXTS - 1]
        if sliding_window not in slots:
            lens = ctx.context_lens_cpu
            device = ctx.block_tables.device
            first = [0 if sliding_window is None else max(0, n - sliding_window) for n in lens]
            length = max(n - f for n, f in zip(lens, first))
            first_t = torch.tensor(first, device=device)
            lens_t = torch.tensor(lens, device=device)
            pos = first_t[:, None] + torch.arange(length, device=device)[None, :]  # [B, L]
            tok = torch.minimum(pos, lens_t[:, None] - 1)
            blk = ctx.block_tables.long().gather(1, tok // block_size)
            full = all(n - f == length for n, f in zip(lens, first))
            mask = None if full else (pos < lens_t[:, None])[:, None, None, :]
            slots[sliding_window] = (blk, tok % block_size, mask)
        return slots[sliding_window]


def _same(key: tuple, old: tuple | None) -> bool:
    """Keys of (tensor, ..., other fields): the same tensor objects and equal other fields."""
    return old is not None and all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(key, old))


MEMO_CONTEXTS = 2  # a step's contexts of both KV kinds (runner/context.py for_kind), so alternating layers reuse
_MEMO = _StepMemo()


_backend = TorchAttentionBackend()


def set_attention_backend(backend) -> None:
    """Install a backend with store_kv / rotary_store_kv / attend of the signatures above (e.g. Triton kernels on
    the GPU)."""
    global _backend
    _backend = backend


class Attention(nn.Module):
    """Stores this step's K/V into the layer's cache, then attends over the cache (including them).

    sliding_window W (tokens, >= 1): the query at position i sees keys j with i - W < j <= i (transformers' sliding
    window); logit_softcap c (> 0): scores = c * tanh(scores / c) before the mask and softmax (Gemma 2); scale: the
    factor on q.k (None: head_dim ** -0.5)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 logit_softcap: float | None = None, scale: float | None = None):
        super().__init__()
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"Attention: sliding_window must be a positive int or None, got {sliding_window!r}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"Attention: logit_softcap must be > 0 or None, got {logit_softcap!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)
        self.kv_cache: torch.Tensor | None = None  # assigned by the ModelRunner
        self.kv_kind = 0  # which KV pool (and the step's slots and block tables) it uses: runner/kv_cache.py
        self.k_scale = torch.tensor(1.0)  # float32 scalars, used only with an FP8 cache
        self.v_scale = torch.tensor(1.0)

    def forward(self, q, k, v, ctx: StepContext, out_scale=None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hk*D] -> [T, Hq*D] (float8_e4m3fn, out / out_scale, when out_scale is given)."""
        t, ctx = q.shape[0], ctx.for_kind(self.kv_kind)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        _backend.store_kv(k, v, self.kv_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q, ctx, out_scale)

    def forward_qkv(self, qkv, cos_sin_cache, part_scales, ctx: StepContext, out_scale=None,
                    qk_norm=None) -> torch.Tensor:
        """qkv [T, >= (Hq+2Hk)*D], the fused projection's rows (part_scales: fp32 [3] or None, see rotary_qk_ref) ->
        [T, Hq*D] as forward gives: rotary and the K/V store in one backend call (qk_norm: (q weight, k weight, eps)
        of per-head RMSNorms before the rotary, in the same call)."""
        ctx = ctx.for_kind(self.kv_kind)
        q = _backend.rotary_store_kv(qkv, self.num_heads, self.num_kv_heads, ctx.positions, cos_sin_cache,
                                     part_scales, self.kv_cache, ctx.slot_mapping, self.k_scale, self.v_scale,
                                     qk_norm)
        return self._attend(q.view(q.shape[0], self.num_heads, self.head_dim), ctx, out_scale)

    def _attend(self, q, ctx: StepContext, out_scale) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq*D]."""
        extra = {}  # only when set, so a backend without windows or softcap keeps working for plain models
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.logit_softcap is not None:
            extra["logit_softcap"] = self.logit_softcap
        out = _backend.attend(q, self.kv_cache, ctx, self.scale, self.k_scale, self.v_scale, out_scale, **extra)
        return out.reshape(q.shape[0], -1)
