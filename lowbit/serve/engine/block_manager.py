"""Paged KV blocks: allocation with reference counts and prefix reuse by hash-chained full blocks. Torch-free.

A block is reusable once it is full AND its K/V are computed (`commit`). A freed block keeps its hash and stays
findable until the free list hands it out again (least recently freed first), so a recomputed or repeated
prefix finds it. With a host pool (`host_blocks`), a hashed block the free list hands out again is first copied to
the host (an offload move), and a prefix match continues past the device hits into the host pool: those blocks get
fresh device blocks and are copied back (restore moves) instead of recomputed. `take_moves` hands a step's moves to
the runner, which applies them before the step's forward.

With a sliding window W (every attention layer windowed, W the largest window), a running sequence gives back the
blocks that ended before its next query's window (`release_outside_window`): the attention never reads them again.
Its block_table keeps their ids (positions stay put and the table only grows; the stale entries point at blocks
that may be reused elsewhere, which the window masks and the kernels never load). Released blocks keep their hash,
as any freed block does: their K/V depend only on the token prefix, so a later prompt with that prefix may still
find them until the free list hands them out. Accounting per layer kind (some layers global) is not done: a model
with any global layer holds its whole history.
"""
from collections import OrderedDict

from lowbit.serve.engine.host_pool import BlockMoves, HostPool
from lowbit.serve.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 host_blocks: int = 0, sliding_window: int | None = None):
        assert num_blocks > 0 and block_size > 0 and (sliding_window is None or sliding_window > 0)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.released: dict[int, tuple[int, int | None]] = {}  # seq_id -> (leading blocks released, last one's hash)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up at admission (for the prefix hit rate)
        self.num_hit_tokens = 0
        self.host = HostPool(host_blocks) if host_blocks and enable_prefix_caching else None
        self.moves = BlockMoves()  # this step's copies to and from the host pool, for the runner
        self.num_host_hit_tokens = 0
        self.num_offloaded = 0  # blocks copied to the host pool
        self.num_restored = 0  # blocks copied back from it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
            if self.host is not None:
                self._offload(block)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    # ---- admission: prefix match, then blocks for the first chunk
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids for the longest computed prefix of seq; never the block holding its last token."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        matched, prev = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i, self.block_size)
            prev = chain_hash(prev, tokens)
            block_id = self.hash_to_block_id.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
        return matched

    def can_allocate(self, seq: Sequence, matched: list[int], num_new_tokens: int) -> bool:
        num_cached = len(matched) * self.block_size
        needed = self._blocks_for(num_cached + num_new_tokens) - len(matched)
        revived = sum(1 for b in matched if self.blocks[b].ref_count == 0)  # leave the free list when reused
        return needed <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, matched: list[int], num_new_tokens: int, restored: list[int] = ()) -> None:
        """restored: `match_host`'s hashes, continuing matched (num_new_tokens excludes their tokens)."""
        assert not seq.block_table
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(matched)
        self._restore(seq, restored)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        seq.num_hashed_blocks = len(seq.block_table)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens
        self.append(seq, num_new_tokens)

    # ---- growth while running (a held block_table only grows by append; the runner relies on it)
    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The sequence's blocks already hold its next num_new_tokens tokens."""
        return seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks past the first num_tokens tokens (speculative decoding's rejected drafts). Those
        blocks hold no computed token of seq's history, so they are unhashed. A shorter table is a new list (held
        tables only grow: runner/block_tables.py rewrites a row when its list changes)."""
        keep = max(self._blocks_for(num_tokens), seq.num_hashed_blocks)
        if len(seq.block_table) <= keep:
            return
        for block_id in reversed(seq.block_table[keep:]):
            assert self.blocks[block_id].hash is None
            self._unref(block_id)
        seq.block_table = seq.block_table[:keep]

    def commit(self, seq: Sequence) -> None:
        """Make the full, computed blocks of seq findable by later prefixes."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        released, released_hash = self.released.get(seq.seq_id, (0, None))
        for i in range(seq.num_hashed_blocks, full):
            prev = None if i == 0 else released_hash if i == released else self.blocks[seq.block_table[i - 1]].hash
            block = self.blocks[seq.block_table[i]]
            block.token_ids = seq.block(i, self.block_size)
            block.hash = chain_hash(prev, block.token_ids)
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def release_outside_window(self, seq: Sequence) -> None:
        """Frees the leading blocks of a running sequence that end before the window of its next query (position
        num_computed_tokens, which sees keys after num_computed_tokens - W). With prefix caching, only blocks already
        registered (commit), so the hash chain of later blocks stays computable."""
        if self.sliding_window is None:
            return
        released, _ = self.released.get(seq.seq_id, (0, None))
        upto = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:
            upto = min(upto, seq.num_hashed_blocks)
        if upto <= released:
            return
        for block_id in seq.block_table[released:upto]:
            self._unref(block_id)
        self.released[seq.seq_id] = (upto, self.blocks[seq.block_table[upto - 1]].hash)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def deallocate(self, seq: Sequence) -> None:
        released, _ = self.released.pop(seq.seq_id, (0, None))
        for block_id in reversed(seq.block_table[released:]):  # tail blocks first: evicted before shared heads
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_hashed_blocks = 0

    # ---- the host pool (host_blocks > 0): offload on eviction, restore on a match
    def match_host(self, seq: Sequence, matched: list[int]) -> list[int]:
        """Hashes of the blocks after `matched` found in the host pool, in order, up to the first miss; never the
        block holding seq's last token."""
        if self.host is None or seq.wants_prompt_logprobs:
            return []
        found = []
        prev = self.blocks[matched[-1]].hash if matched else None
        for i in range(len(matched), (seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i, self.block_size)
            prev = chain_hash(prev, tokens)
            if self.host.lookup(prev, tokens) is None:
                break
            found.append(prev)
        return found

    def _restore(self, seq: Sequence, hashes: list[int]) -> None:
        """Fresh device blocks for the host hits `hashes`, appended to seq's table, findable at once (the copy runs
        before the step's forward); each one's restore move."""
        slots = [self.host.pin(h) for h in hashes]  # before taking blocks: their offloads must not evict these
        for h, slot in zip(hashes, slots):
            block = self.blocks[self._take_free_block()]
            block.hash, block.token_ids = h, self.host.entries[h][1]
            self.hash_to_block_id.setdefault(h, block.block_id)
            seq.block_table.append(block.block_id)
            self.moves.restore.append((slot, block.block_id))
        self.num_restored += len(hashes)
        self.num_host_hit_tokens += len(hashes) * self.block_size

    def _offload(self, block: Block) -> None:
        slot = self.host.put(block.hash, block.token_ids)
        if slot is not None:
            self.moves.offload.append((block.block_id, slot))
            self.num_offloaded += 1

    def take_moves(self) -> BlockMoves | None:
        """This step's moves (None: none), handed to the runner once per step after scheduling. An offload into a
        slot that a later offload of the same step reuses is dropped."""
        if self.host is None or not self.moves:
            return None
        moves, self.moves = self.moves, BlockMoves()
        last = {slot: i for i, (_, slot) in enumerate(moves.offload)}
        moves.offload = [m for i, m in enumerate(moves.offload) if last[m[1]] == i]
        self.host.unpin_all()
        return moves
