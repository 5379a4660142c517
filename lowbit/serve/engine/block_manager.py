"""Paged KV blocks: allocation with reference counts and prefix reuse by hash-chained full blocks, in one pool per
layer kind. Torch-free.

A block is reusable once it is full AND its K/V are computed (`commit`). A freed block keeps its hash and stays
findable until the free list hands it out again (least recently freed first), so a recomputed or repeated
prefix finds it. With a host pool (`host_blocks`, one kind only), a hashed block the free list hands out again is
first copied to the host (an offload move), and a prefix match continues past the device hits into the host pool:
those blocks get fresh device blocks and are copied back (restore moves) instead of recomputed. `take_moves` hands a
step's moves to the runner, which applies them before the step's forward.

Layer kinds: the layers of one kind share a pool (`KvPool`) of their own block count and each sequence holds one
block table per kind (`Sequence.block_tables`, kind 0 first). A kind is full attention (window None) or windowed
(window W, the largest window of its layers); a model with one kind has one pool. In a windowed kind's pool a
running sequence gives back the blocks that ended before its next query's window (`release_outside_window`): its
layers never read them again. Its table keeps their ids (positions stay put and the table only grows; the stale
entries point at blocks that may be reused elsewhere, which the window masks and the kernels never load). Released
blocks keep their hash, as any freed block does: their K/V depend only on the token prefix, so a later prompt with
that prefix may still find them until the free list hands them out. A prefix hit of L tokens needs, in each kind's
pool, the blocks its layers read from position L on: all of [0, L) for a full kind, those from L - W + 1 for a
windowed one (the earlier entries point at block 0 and count as released).
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


class KvPool:
    """One layer kind's blocks: free list, hash index, and the leading blocks each running sequence released."""

    def __init__(self, num_blocks: int, window: int | None):
        assert num_blocks > 0 and (window is None or window > 0)
        self.window = window  # None: full attention
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.released: dict[int, tuple[int, int | None]] = {}  # seq_id -> (leading blocks not held, last one's hash)

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self.hash_to_block_id.get(h)
        return block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None

    def first_read(self, num_tokens: int, block_size: int) -> int:
        """The first block a query at position num_tokens (or later) reads: 0 for a full kind."""
        return 0 if self.window is None else max(0, num_tokens - self.window + 1) // block_size

    def unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None


class Match(list):
    """match_prefix's answer: kind 0's block ids of the hit (a list, as with one kind), every kind's table of it in
    `tables` (entries before `skipped[k]` are placeholders, not held) and the chain hashes of its blocks."""

    def __init__(self, tables: list[list[int]], skipped: list[int], hashes: list[int]):
        super().__init__(tables[0])
        self.tables, self.skipped, self.hashes = tables, skipped, hashes


class BlockManager:
    def __init__(self, num_blocks: int | list[int], block_size: int = 16, enable_prefix_caching: bool = True,
                 host_blocks: int = 0, sliding_window: int | None | list[int | None] = None):
        """num_blocks, sliding_window: one pool, or lists of one entry per layer kind (kind 0 first)."""
        counts = num_blocks if isinstance(num_blocks, list) else [num_blocks]
        windows = sliding_window if isinstance(sliding_window, list) else [sliding_window]
        assert block_size > 0 and len(counts) == len(windows) >= 1
        assert not (host_blocks and len(counts) > 1), "a host pool holds one kind's blocks"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [KvPool(n, w) for n, w in zip(counts, windows)]
        self.num_queried_tokens = 0  # prompt tokens looked up at admission (for the prefix hit rate)
        self.num_hit_tokens = 0
        self.host = HostPool(host_blocks) if host_blocks and enable_prefix_caching else None
        self.moves = BlockMoves()  # this step's copies to and from the host pool, for the runner
        self.num_host_hit_tokens = 0
        self.num_offloaded = 0  # blocks copied to the host pool
        self.num_restored = 0  # blocks copied back from it

    # kind 0's pool under the names of a one-pool manager
    blocks = property(lambda self: self.pools[0].blocks)
    hash_to_block_id = property(lambda self: self.pools[0].hash_to_block_id)
    released = property(lambda self: self.pools[0].released)

    @property
    def sliding_window(self) -> int | None:
        return self.pools[0].window

    @sliding_window.setter
    def sliding_window(self, window: int | None) -> None:
        self.pools[0].window = window

    @property
    def num_blocks(self) -> int:
        return sum(len(p.blocks) for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(p.free_block_ids) for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def used_blocks_by_kind(self) -> list[int]:
        return [len(p.blocks) - len(p.free_block_ids) for p in self.pools]

    def _blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free_block(self, pool: KvPool) -> int:
        block_id, _ = pool.free_block_ids.popitem(last=False)
        block = pool.blocks[block_id]
        if block.hash is not None and pool.hash_to_block_id.get(block.hash) == block_id:
            del pool.hash_to_block_id[block.hash]
            if self.host is not None:
                self._offload(block)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    # ---- admission: prefix match, then blocks for the first chunk
    def match_prefix(self, seq: Sequence) -> Match:
        """Cached blocks of the longest computed prefix of seq that every kind's pool can serve; never the block
        holding seq's last token."""
        none = Match([[] for _ in self.pools], [0] * len(self.pools), [])
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return none
        hashes, found, prev = [], [[] for _ in self.pools], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i, self.block_size)
            prev = chain_hash(prev, tokens)
            hashes.append(prev)
            for pool, ids in zip(self.pools, found):
                ids.append(pool.lookup(prev, tokens))
            if any(ids[-1] is None for pool, ids in zip(self.pools, found) if pool.window is None):
                break  # a full kind needs every block
        misses = [[i for i, b in enumerate(ids) if b is None] for ids in found]
        for n in range(len(hashes), 0, -1):  # the longest hit every pool serves: no miss in [first read, n)
            first = [p.first_read(n * self.block_size, self.block_size) for p in self.pools]
            for m in misses:  # n only shrinks: misses at or past it no longer matter
                while m and m[-1] >= n:
                    m.pop()
            if all(not m or m[-1] < f for m, f in zip(misses, first)):
                return Match([[0] * f + ids[f:n] for ids, f in zip(found, first)], first, hashes[:n])
        return none

    def _as_match(self, matched: list[int]) -> Match:
        """A plain list of kind 0's block ids (one kind only, or empty) as a Match."""
        if isinstance(matched, Match):
            return matched
        assert not matched or len(self.pools) == 1, "with several kinds, pass match_prefix's Match"
        return Match([list(matched)] + [[] for _ in self.pools[1:]], [0] * len(self.pools), [])

    def can_allocate(self, seq: Sequence, matched: list[int], num_new_tokens: int) -> bool:
        m = self._as_match(matched)
        needed = self._blocks_for(len(m) * self.block_size + num_new_tokens) - len(m)
        for pool, table, skipped in zip(self.pools, m.tables, m.skipped):
            revived = sum(1 for b in table[skipped:] if pool.blocks[b].ref_count == 0)  # leave the free list
            if needed > len(pool.free_block_ids) - revived:
                return False
        return True

    def allocate(self, seq: Sequence, matched: list[int], num_new_tokens: int, restored: list[int] = ()) -> None:
        """restored: `match_host`'s hashes, continuing matched (num_new_tokens excludes their tokens)."""
        assert not any(seq.block_tables)
        m = self._as_match(matched)
        seq.block_tables = [list(t) for t in m.tables]
        for pool, table, skipped in zip(self.pools, seq.block_tables, m.skipped):
            for block_id in table[skipped:]:
                block = pool.blocks[block_id]
                if block.ref_count == 0:
                    del pool.free_block_ids[block_id]
                block.ref_count += 1
            if skipped:
                pool.released[seq.seq_id] = (skipped, m.hashes[skipped - 1])
        self._restore(seq, restored)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        seq.num_hashed_blocks = len(seq.block_table)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens
        self.append(seq, num_new_tokens)

    # ---- growth while running (a held block table only grows by append; the runner relies on it)
    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The sequence's blocks already hold its next num_new_tokens tokens (every kind's table has one length)."""
        return seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return all(needed <= len(p.free_block_ids) for p in self.pools)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for pool, table in zip(self.pools, seq.block_tables):
            for _ in range(needed):
                table.append(self._take_free_block(pool))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks past the first num_tokens tokens (speculative decoding's rejected drafts). Those
        blocks hold no computed token of seq's history, so they are unhashed. A shorter table is a new list (held
        tables only grow: runner/block_tables.py rewrites a row when its list changes)."""
        keep = max(self._blocks_for(num_tokens), seq.num_hashed_blocks)
        if len(seq.block_table) <= keep:
            return
        for k, pool in enumerate(self.pools):
            table = seq.block_tables[k]
            released, _ = pool.released.get(seq.seq_id, (0, None))
            for block_id in reversed(table[max(keep, released):]):
                assert pool.blocks[block_id].hash is None
                pool.unref(block_id)
            seq.block_tables[k] = table[:keep]

    def commit(self, seq: Sequence) -> None:
        """Make the full, computed blocks of seq findable by later prefixes."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for pool, table in zip(self.pools, seq.block_tables):
            released, released_hash = pool.released.get(seq.seq_id, (0, None))
            for i in range(seq.num_hashed_blocks, full):
                prev = None if i == 0 else released_hash if i == released else pool.blocks[table[i - 1]].hash
                block = pool.blocks[table[i]]
                block.token_ids = seq.block(i, self.block_size)
                block.hash = chain_hash(prev, block.token_ids)
                pool.hash_to_block_id.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def release_outside_window(self, seq: Sequence) -> None:
        """In each windowed kind's pool, frees the leading blocks of a running sequence that end before the window
        of its next query (position num_computed_tokens, which sees keys after num_computed_tokens - W). With prefix
        caching, only blocks already registered (commit), so the hash chain of later blocks stays computable."""
        for pool, table in zip(self.pools, seq.block_tables):
            if pool.window is None:
                continue
            released, _ = pool.released.get(seq.seq_id, (0, None))
            upto = pool.first_read(seq.num_computed_tokens, self.block_size)
            if self.enable_prefix_caching:
                upto = min(upto, seq.num_hashed_blocks)
            if upto <= released:
                continue
            for block_id in table[released:upto]:
                pool.unref(block_id)
            pool.released[seq.seq_id] = (upto, pool.blocks[table[upto - 1]].hash)

    def deallocate(self, seq: Sequence) -> None:
        for pool, table in zip(self.pools, seq.block_tables):
            released, _ = pool.released.pop(seq.seq_id, (0, None))
            for block_id in reversed(table[released:]):  # tail blocks first: evicted before shared heads
                pool.unref(block_id)
        seq.block_tables = [[] for _ in self.pools]
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_hashed_blocks = 0

    # ---- the host pool (host_blocks > 0, one kind): offload on eviction, restore on a match
    def match_host(self, seq: Sequence, matched: list[int]) -> list[int]:
        """Hashes of the blocks after `matched` found in the host pool, in order, up to the first miss; never the
        block holding seq's last token."""
        if self.host is None or seq.wants_prompt_logprobs:
            return []
        found = []
        prev = matched.hashes[-1] if isinstance(matched, Match) and matched.hashes else \
            self.blocks[matched[-1]].hash if matched else None
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
        if not hashes:
            return
        pool = self.pools[0]
        slots = [self.host.pin(h) for h in hashes]  # before taking blocks: their offloads must not evict these
        for h, slot in zip(hashes, slots):
            block = pool.blocks[self._take_free_block(pool)]
            block.hash, block.token_ids = h, self.host.entries[h][1]
            pool.hash_to_block_id.setdefault(h, block.block_id)
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
