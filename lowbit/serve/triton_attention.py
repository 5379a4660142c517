"""The GPU attention backend behind serve.attention's store_kv / attend: lowbit.kernels.paged_attention (KV store,
decode) and lowbit.kernels.paged_prefill (prefill, extend).

Decode steps read only device tensors (graph-capturable); other steps size their grid from the host query lengths.
"""
import torch

from lowbit.kernels import paged_attention as pa
from lowbit.kernels.paged_prefill import paged_prefill
from lowbit.serve.context import StepContext


class TritonAttentionBackend:
    @staticmethod
    def store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale) -> None:
        pa.store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def attend(q, kv_cache, ctx: StepContext, scale: float, k_scale, v_scale, out_scale=None) -> torch.Tensor:
        if ctx.is_decode:
            return pa.paged_decode(q, kv_cache, ctx.block_tables, ctx.context_lens, scale, k_scale, v_scale,
                                   out_scale=out_scale)
        return paged_prefill(q, kv_cache, ctx.query_start_loc, ctx.context_lens, ctx.block_tables,
                             max(ctx.query_lens_cpu), scale, k_scale, v_scale, out_scale)
