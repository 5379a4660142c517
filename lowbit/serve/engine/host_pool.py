"""Which prefix blocks have a copy in the host KV pool: slots keyed by block hash, LRU within a fixed count. Torch-free.

The block manager decides, the runner moves the bytes (`runner/host_cache.py`): each step's moves are one list of
offloads (device block -> host slot) and one of restores (host slot -> device block), applied offloads first, before
the step's forward. So an entry restored in a step must not lose its slot to an offload of the same step
(`pin`); an entry offloaded and restored in the same step is fine (its bytes land before they are read).
"""
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class BlockMoves:
    """One step's copies between the device KV pool and the host pool."""
    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    restore: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block id)

    def __bool__(self) -> bool:
        return bool(self.offload or self.restore)


class HostPool:
    def __init__(self, num_slots: int):
        assert num_slots > 0
        self.num_slots = num_slots
        self.entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens); LRU first
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.pinned: set[int] = set()  # hashes restored in the current step: not evicted before its moves ran

    @property
    def num_used(self) -> int:
        return len(self.entries)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding this block (same hash and tokens), or None."""
        entry = self.entries.get(block_hash)
        return entry[0] if entry is not None and entry[1] == token_ids else None

    def pin(self, block_hash: int) -> int:
        """Marks the entry most recently used and keeps it until `unpin_all`; returns its slot."""
        self.entries.move_to_end(block_hash)
        self.pinned.add(block_hash)
        return self.entries[block_hash][0]

    def unpin_all(self) -> None:
        self.pinned.clear()

    def put(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """A slot to copy the block into, evicting the least recently used unpinned entry when full; None when the
        block is there already (only marked used) or every slot is pinned."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if not self.free_slots:
            victim = next((h for h in self.entries if h not in self.pinned), None)
            if victim is None:
                return None
            self.free_slots.append(self.entries.pop(victim)[0])
        slot = self.free_slots.pop()
        self.entries[block_hash] = (slot, token_ids)
        return slot
