"""The KV cache: sized from free memory (like TensorRT-LLM's KvCacheConfig), then allocated, one tensor per layer.

Each attention layer's cache is [2, num_blocks, block_size, num_kv_heads, head_dim] in the KV dtype (the model dtype
or float8_e4m3fn). On the GPU, blocks = free_gpu_memory_fraction x (memory free after the weights and a warm-up
forward of max_num_tokens, less that forward's activation peak) / bytes per block, capped by max_tokens; on the CPU,
a fraction of the available RAM. A draft model (speculative decoding) shares that budget: `KvPartner` adds its bytes
per block and its warm-up peak, and both pools get the same number of blocks. A model with full and windowed layers
has a pool per layer kind, the windowed one no larger than its layers can read at once (`split_kv_budget`).
"""
from dataclasses import dataclass

import torch

from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.runner.context import StepContext

# Prefills run before the pool is sized, besides the max_num_tokens one that measures the peak: two per row range of
# the W4 GEMM configs (w4a16._m_bucket: <= 16, <= 32, <= 64, <= 128, <= 512, more), a multiple of 16 and not (Triton
# specializes integer arguments on divisibility by 16), so no request compiles a kernel for its prompt length (a
# compile stalls a request ~1-2 s). The larger ones also grow w4_dequant's scratch (W4 layers from
# w4a16.DEQUANT_MIN_M rows) to its final size before the pool is sized and graphs captured.
WARM_UP_PREFILLS = (15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 1023)


@dataclass
class KvPartner:
    """A second model on the same device whose KV pool is sized out of the same budget (a draft model)."""
    model: torch.nn.Module
    attn_layers: list
    kv_dtype: torch.dtype


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def allocate_kv_cache(model, attn_layers, config: EngineConfig, kv_dtype: torch.dtype, device: torch.device,
                      partner: KvPartner | None = None, windows: list[int | None] = (None,)) -> list[int]:
    """Gives every attention layer its cache of config.num_kv_blocks blocks, or of as many as fit (with a partner:
    as many as fit when each block also holds the partner's K/V for as many tokens); returns that number of blocks
    per layer kind (`assign_kv_kinds`: windows[k] is kind k's window). With two kinds that budget, counted in blocks
    of every layer, is split by `split_kv_budget`. The partner's own pool is allocated by its runner."""
    num_blocks = config.num_kv_blocks or blocks_that_fit(model, attn_layers, config, kv_dtype, device, partner)
    counts = [num_blocks] if len(windows) == 1 else split_kv_budget(num_blocks, attn_layers, windows, config)
    a = attn_layers[0]
    for layer in attn_layers:
        shape = (2, counts[layer.kv_kind], config.block_size, a.num_kv_heads, a.head_dim)
        layer.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    return counts


def assign_kv_kinds(attn_layers, split: bool = True) -> list[int | None]:
    """Sets each attention layer's kv_kind; returns each kind's window (None: full attention). A model with both
    full and windowed layers has kind 0 (full) and kind 1 (windowed, window: the largest of its layers) when split,
    else one kind of full attention; a model whose layers are all windowed has one windowed kind."""
    windows = [m.sliding_window for m in attn_layers]
    mixed = None in windows and any(w is not None for w in windows)
    for m in attn_layers:
        m.kv_kind = 1 if mixed and split and m.sliding_window is not None else 0
    if mixed and split:
        return [None, max(w for w in windows if w is not None)]
    return [None if not windows or None in windows else max(windows)]


def split_kv_budget(num_blocks: int, attn_layers, windows: list[int | None], config: EngineConfig) -> list[int]:
    """num_blocks blocks of every layer -> [full kind's, windowed kind's] blocks in the same bytes. The windowed
    kind gets what max_batch_size sequences can hold at once, (window + max_num_tokens) / block_size + 2 blocks
    each (a prefill chunk's blocks stay until it is computed; partial blocks at both ends), at most num_blocks;
    the full kind the rest of the bytes (so at least num_blocks)."""
    per_kind = [sum(1 for m in attn_layers if m.kv_kind == k) for k in range(2)]  # every layer has one K/V shape
    window_blocks = min(num_blocks, config.max_batch_size * (cdiv(windows[1] + config.max_num_tokens,
                                                                  config.block_size) + 2))
    full_blocks = (num_blocks * (per_kind[0] + per_kind[1]) - window_blocks * per_kind[1]) // per_kind[0]
    return [full_blocks, window_blocks]


def bytes_per_block(attn_layers, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block across every layer's K and V."""
    per_token = sum(2 * m.num_kv_heads * m.head_dim for m in attn_layers)
    return per_token * block_size * torch.empty((), dtype=kv_dtype).element_size()


def blocks_that_fit(model, attn_layers, config: EngineConfig, kv_dtype: torch.dtype, device: torch.device,
                    partner: KvPartner | None = None) -> int:
    """GPU: after the warm-up prefills, kv_cache_fraction (default 0.9) of the free memory less the activation peak,
    capped by kv_cache_max_tokens; CPU: kv_cache_fraction (default 0.05) of the available RAM. A partner's bytes per
    block are added to each block, and its warm-up peak counts when larger (the two models never run at once)."""
    models = [(model, attn_layers, kv_dtype)] + ([(partner.model, partner.attn_layers, partner.kv_dtype)]
                                                 if partner is not None else [])
    nbytes = sum(bytes_per_block(layers, config.block_size, dt) for _, layers, dt in models)
    if device.type == "cuda":
        peak = 0
        for m, layers, dt in models:
            for n in (n for n in WARM_UP_PREFILLS if n < config.max_num_tokens):  # they only build kernels
                warm_up_peak(m, layers, n, config.block_size, dt, device)
            peak = max(peak, warm_up_peak(m, layers, config.max_num_tokens, config.block_size, dt, device))
        return gpu_blocks_that_fit(nbytes, config.block_size, peak, device, config.kv_cache_fraction or 0.9,
                                   config.kv_cache_max_tokens)
    budget = _available_ram() * (config.kv_cache_fraction or 0.05)
    return max(1, int(budget // nbytes))


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
    ctx.with_kinds([(ctx.slot_mapping, ctx.block_tables)] * max(m.kv_kind for m in attn_layers))  # alike pools
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


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")
