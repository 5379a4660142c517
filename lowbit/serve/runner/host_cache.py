"""The host KV pool's bytes: evicted prefix blocks copied to host memory (pinned on CUDA) and back, in batches.

The pool is one tensor [slots, layers, 2, block elements] in the cache's storage type (uint8 for an FP8 cache: its
bytes as stored, V transposed within each block included). A step's moves (`engine/host_pool.py: BlockMoves`) run on
the current stream before its forward, offloads first: per chunk of blocks, one gather per layer into a device
staging buffer, then one copy per run of consecutive host slots (moves are sorted by slot, so a prefix offloaded
together moves in one copy), and for restores the reverse. Stream order keeps every copy behind the forwards queued
before it and ahead of the ones after, so nothing waits on the host.
"""
import torch

from lowbit.serve.engine.host_pool import BlockMoves

STAGING_BYTES = 64 << 20  # device staging per chunk of moved blocks


def storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache's memory in a type that index copies take (float8 as uint8: the same bytes)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


class HostCache:
    def __init__(self, caches: list[torch.Tensor], num_slots: int):
        """caches: every attention layer's [2, num_blocks, block_size, Hk, D] KV cache (all one shape)."""
        self.caches = [storage(c) for c in caches]
        c = self.caches[0]
        self.device = c.device
        self.block_elems = c[0, 0].numel()  # one block's K (or V) of one layer
        self.pool = torch.empty(num_slots, len(caches), 2, self.block_elems, dtype=c.dtype, device="cpu",
                                pin_memory=self.device.type == "cuda")
        self.chunk = max(1, STAGING_BYTES // (self.pool[0].numel() * c.element_size()))

    @classmethod
    def sized(cls, caches: list[torch.Tensor], nbytes: int) -> "HostCache":
        """A pool of as many blocks as nbytes holds; a ValueError when not even one fits."""
        per_block = sum(c[:, 0].numel() * c.element_size() for c in caches)
        if nbytes < per_block:
            raise ValueError(f"host_cache_size {nbytes} bytes holds no KV block ({per_block} bytes each)")
        return cls(caches, nbytes // per_block)

    @property
    def num_slots(self) -> int:
        return self.pool.shape[0]

    @property
    def bytes_per_slot(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()

    def apply(self, moves: BlockMoves) -> None:
        offload, restore = sorted(moves.offload, key=lambda m: m[1]), sorted(moves.restore)
        for i in range(0, len(offload), self.chunk):
            self._offload(offload[i:i + self.chunk])
        for i in range(0, len(restore), self.chunk):
            self._restore(restore[i:i + self.chunk])

    def _index(self, ids: list[int]) -> torch.Tensor:
        """ids on the device without waiting for the stream (through pinned memory on CUDA)."""
        t = torch.tensor(ids, dtype=torch.int64, device="cpu")  # host-side, whatever the default device
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _offload(self, moves: list[tuple[int, int]]) -> None:
        blocks = self._index([b for b, _ in moves])
        staging = torch.empty((len(moves),) + self.pool.shape[1:], dtype=self.pool.dtype, device=self.device)
        for layer, cache in enumerate(self.caches):  # [2, n, bs, Hk, D] -> [n, 2, block elems]
            staging[:, layer] = cache.index_select(1, blocks).flatten(2).transpose(0, 1)
        for start, end, slot in _runs([s for _, s in moves]):
            self.pool[slot:slot + end - start].copy_(staging[start:end], non_blocking=True)

    def _restore(self, moves: list[tuple[int, int]]) -> None:
        blocks = self._index([b for _, b in moves])
        staging = torch.empty((len(moves),) + self.pool.shape[1:], dtype=self.pool.dtype, device=self.device)
        for start, end, slot in _runs([s for s, _ in moves]):
            staging[start:end].copy_(self.pool[slot:slot + end - start], non_blocking=True)
        for layer, cache in enumerate(self.caches):
            src = staging[:, layer].transpose(0, 1).reshape((2, len(moves)) + cache.shape[2:])
            cache.index_copy_(1, blocks, src)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, first slot) of each run of consecutive slots in an ascending list."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs
