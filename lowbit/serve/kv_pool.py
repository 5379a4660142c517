"""KV pool sizing on the GPU, like TensorRT-LLM's KvCacheConfig.

blocks = free_gpu_memory_fraction x (memory free after the weights and a warm-up forward of max_num_tokens,
less that forward's activation peak) / bytes per block, capped by max_tokens.
"""
import torch

from lowbit.kernels._triton import cdiv
from lowbit.serve.context import StepContext


def warm_up_peak(model, attn_layers, num_tokens: int, block_size: int, kv_dtype, device) -> int:
    """Runs one prefill of num_tokens through a temporary KV pool; returns its activation peak in bytes."""
    a = attn_layers[0]
    nblk = cdiv(num_tokens, block_size)
    for layer in attn_layers:
        layer.kv_cache = torch.zeros(2, nblk, block_size, a.num_kv_heads, a.head_dim, dtype=kv_dtype, device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ctx = StepContext(positions=torch.arange(num_tokens, device=device),
                      slot_mapping=torch.arange(num_tokens, device=device),
                      query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
                      context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
                      block_tables=torch.arange(nblk, dtype=torch.int32, device=device)[None],
                      logits_indices=torch.tensor([num_tokens - 1], device=device), is_decode=False,
                      query_lens_cpu=[num_tokens], context_lens_cpu=[num_tokens])
    with torch.inference_mode():
        model.compute_logits(model(torch.zeros(num_tokens, dtype=torch.int64, device=device), ctx)[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    for layer in attn_layers:
        layer.kv_cache = None
    torch.cuda.empty_cache()
    return peak


def gpu_blocks_that_fit(block_bytes: int, block_size: int, activation_peak: int, device,
                        free_gpu_memory_fraction: float = 0.9, max_tokens: int | None = None) -> int:
    free = torch.cuda.mem_get_info(device)[0]
    blocks = int(max(0, free - activation_peak) * free_gpu_memory_fraction // block_bytes)
    if max_tokens is not None:
        blocks = min(blocks, cdiv(max_tokens, block_size))
    if blocks < 1:
        raise RuntimeError(f"no room for a KV block: {free / 2**30:.1f} GiB free, activation peak "
                           f"{activation_peak / 2**30:.1f} GiB")
    return blocks
