"""Tokens sorted by expert, each expert's run padded to whole row blocks, computed on the device without a host sync.

A (token, slot) pair is the flat index i = token * top_k + slot of topk_ids [T, top_k]. sorted_ids [P] lists the
pairs expert by expert (stable: ascending i within an expert), each expert's run padded with the sentinel T * top_k
to a multiple of block_m; block_expert [P / block_m] is the expert of each row block, -1 for blocks past the last
run. P = the bound T * top_k + E * (block_m - 1) rounded up to block_m, so shapes depend on T alone (CUDA graphs).
"""
import torch

from lowbit.kernels._triton import helper, tl


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P: enough rows for every expert's run rounded up to block_m."""
    bound = num_pairs + num_experts * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] (int) -> (sorted_ids int32 [P], block_expert int32 [P / block_m])."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    # scatter_add, not bincount: bincount reads its input's max on the host, which a CUDA graph cannot capture
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]  # position within its expert
    size = padded_size(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@helper
def block_rows(sorted_ptr, pid_m, num_pairs, A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m of sorted_ids -> (pairs [BLOCK_M], row_ok: not padding, int64 rows of a to read: pair //
    A_ROW_DIV, 0 for padding)."""
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    return pairs, row_ok, tl.where(row_ok, pairs // A_ROW_DIV, 0).to(tl.int64)
