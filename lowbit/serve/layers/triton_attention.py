"""The GPU attention backend behind layers.attention's store_kv / rotary_store_kv / attend: lowbit.kernels'
store_kv and paged_decode (KV store, decode), rotary_store_kv (rotary fused into the KV store) and paged_prefill
(prefill, extend).

Decode steps read only device tensors (graph-capturable); other steps size their grid from the host query lengths.
A mixed step (the scheduler puts decodes first, then prefill chunks) runs its leading one-token sequences through
the decode kernel and the rest through the prefill kernel: the prefill kernel's tiles hold BLOCK_T tokens per
sequence, so a one-token row would waste most of each tile while streaming the same K/V.
"""
import torch

from lowbit.kernels import decode_splits, paged_decode, paged_prefill, rotary_store_kv, store_kv
from lowbit.serve.runner.context import StepContext


def leading_single_tokens(query_lens: list[int]) -> int:
    """How many sequences at the front of the batch have exactly one new token."""
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n


class TritonAttentionBackend:
    @staticmethod
    def store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale) -> None:
        store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def rotary_store_kv(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales, kv_cache,
                        slot_mapping, k_scale, v_scale, qk_norm=None) -> torch.Tensor:
        return rotary_store_kv(qkv, num_q_heads, num_k_heads, positions, cos_sin_cache, part_scales, kv_cache,
                               slot_mapping, k_scale, v_scale, qk_norm)

    @staticmethod
    def attend(q, kv_cache, ctx: StepContext, scale: float, k_scale, v_scale, out_scale=None, sliding_window=None,
               logit_softcap=None) -> torch.Tensor:
        win = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
        n = len(ctx.query_lens_cpu) if ctx.is_decode else leading_single_tokens(ctx.query_lens_cpu)
        splits = decode_splits(n, kv_cache.shape[3]) if n else 0
        if splits > 1:  # a small batch (few lengths to scan): its longest context may call for more splits
            longest = max(ctx.context_lens_cpu[:n])  # keys read: at most the window plus part of one block
            if sliding_window is not None:
                longest = min(longest, sliding_window + kv_cache.shape[2])
            splits = decode_splits(n, kv_cache.shape[3], longest)
        if n == len(ctx.query_lens_cpu):  # decodes, or one-token prompt chunks only: one row per sequence
            return paged_decode(q, kv_cache, ctx.block_tables, ctx.context_lens, scale, k_scale, v_scale,
                                num_splits=splits, out_scale=out_scale, **win)
        if n == 0:
            return paged_prefill(q, kv_cache, ctx.query_start_loc, ctx.context_lens, ctx.block_tables,
                                 max(ctx.query_lens_cpu), scale, k_scale, v_scale, out_scale, **win)
        # rows [0, n) are the n one-token sequences; the prefill kernel indexes q by query_start_loc[n:], whose
        # entries still count from row 0, and leaves rows [0, n) of its output to the decode kernel
        out = paged_prefill(q, kv_cache, ctx.query_start_loc[n:], ctx.context_lens[n:], ctx.block_tables[n:],
                            max(ctx.query_lens_cpu[n:]), scale, k_scale, v_scale, out_scale, **win)
        out[:n] = paged_decode(q[:n], kv_cache, ctx.block_tables[:n], ctx.context_lens[:n], scale, k_scale,
                               v_scale, num_splits=splits, out_scale=out_scale, **win)
        return out
