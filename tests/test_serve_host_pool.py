"""The host KV pool's bookkeeping without torch or a model: offload on eviction, restore on a prefix match, LRU within
the slot budget, pinning within a step, reference counts."""
from lowbit.serve.engine.block_manager import BlockManager, chain_hash
from lowbit.serve.engine.host_pool import HostPool
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.scheduler import Scheduler
from lowbit.serve.engine.sequence import Sequence

BS = 4


def seq(tokens):
    return Sequence(list(tokens), SamplingParams())


def computed(bm, tokens):
    """A sequence admitted, computed and committed, then freed: its full blocks stay findable on the free list."""
    s = seq(tokens)
    bm.allocate(s, bm.match_prefix(s), len(tokens))
    s.num_computed_tokens = len(tokens)
    bm.commit(s)
    table = list(s.block_table)
    bm.deallocate(s)
    return table


def hashes(tokens):
    out, h = [], None
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        h = chain_hash(h, tuple(tokens[i:i + BS]))
        out.append(h)
    return out


def test_a_hashed_block_handed_out_again_is_offloaded_first():
    bm = BlockManager(4, BS, host_blocks=8)
    a = list(range(100, 116))  # 4 full blocks
    table = computed(bm, a)
    assert bm.take_moves() is None  # freed, still on the device: nothing to copy
    computed(bm, list(range(200, 208)))  # takes the two least recently freed: a's tail blocks (freed first)
    moves = bm.take_moves()
    assert [b for b, _ in moves.offload] == [table[3], table[2]] and moves.restore == []
    assert bm.num_offloaded == 2 and bm.host.num_used == 2
    assert {h for h in hashes(a)[2:]} == set(bm.host.entries)
    assert bm.take_moves() is None  # handed out once


def test_a_prefix_match_continues_into_the_host_pool_and_restores():
    bm = BlockManager(6, BS, host_blocks=8)
    a = list(range(100, 116))
    table = computed(bm, a)
    computed(bm, list(range(200, 224)))  # every block of a evicted to the host
    offloaded = dict(bm.take_moves().offload)
    assert set(offloaded) == set(table)
    c = seq(a + [1, 2])  # 18 tokens: 4 full blocks can match
    matched = bm.match_prefix(c)
    restored = bm.match_host(c, matched)
    assert matched == [] and restored == hashes(a)
    assert bm.can_allocate(c, matched, len(restored) * BS + 2)
    bm.allocate(c, matched, 2, restored)
    assert c.num_computed_tokens == c.num_cached_tokens == 16 and c.num_hashed_blocks == 4
    assert len(c.block_table) == 5
    moves = bm.take_moves()
    slot_of = {h: bm.host.entries[h][0] for h in restored}
    assert moves.restore == [(slot_of[h], b) for h, b in zip(restored, c.block_table)]
    assert bm.num_restored == 4 and bm.num_host_hit_tokens == 16
    # restored blocks are findable on the device at once, by the next sequence of the same step
    d = seq(a + [3])
    assert bm.match_prefix(d) == c.block_table[:4]
    bm.allocate(d, c.block_table[:4], 1)
    assert [bm.blocks[b].ref_count for b in c.block_table] == [2, 2, 2, 2, 1]
    bm.deallocate(c)
    bm.deallocate(d)
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_device_hits_then_host_hits():
    bm = BlockManager(6, BS, host_blocks=8)
    a = list(range(100, 116))
    table = computed(bm, a)  # 4 blocks; the free list then holds a's 4 (tail first) behind 2 never used
    computed(bm, list(range(200, 216)))  # takes the 2 unused and a's blocks 3 and 2
    bm.take_moves()
    c = seq(a + [1])
    matched = bm.match_prefix(c)
    assert matched == table[:2]
    restored = bm.match_host(c, matched)
    assert restored == hashes(a)[2:]
    bm.allocate(c, matched, 1, restored)
    assert c.block_table[:2] == table[:2] and c.num_cached_tokens == 16


def test_host_pool_is_lru_within_its_slots():
    pool = HostPool(2)
    assert pool.put(1, (1,)) == 0 and pool.put(2, (2,)) == 1
    assert pool.put(1, (1,)) is None  # there already: only marked used, no copy
    assert pool.put(3, (3,)) == 1  # evicts 2, the least recently used
    assert set(pool.entries) == {1, 3} and pool.lookup(2, (2,)) is None
    assert pool.lookup(3, (9,)) is None  # same hash, other tokens: not this block
    pool.pin(1)  # restored this step: its slot is read by this step's moves
    assert pool.put(4, (4,)) == 1  # evicts 3, not the pinned 1
    pool.pin(4)
    assert pool.put(5, (5,)) is None  # every slot pinned: the block is not kept
    pool.unpin_all()
    assert pool.put(5, (5,)) == 0


def test_a_restore_keeps_its_slot_through_the_offloads_of_its_own_step():
    bm = BlockManager(4, BS, host_blocks=2)
    a = list(range(100, 108))  # 2 blocks
    computed(bm, a)
    computed(bm, list(range(200, 216)))  # a's 2 blocks go to the host's 2 slots
    bm.take_moves()
    c = seq(a + [1])
    restored = bm.match_host(c, bm.match_prefix(c))
    assert len(restored) == 2
    bm.allocate(c, [], 1, restored)  # takes 3 blocks that hold hashed data: their offloads find no free slot
    moves = bm.take_moves()
    assert moves.offload == [] and len(moves.restore) == 2
    assert set(bm.host.entries) == set(restored)


def test_a_later_offload_into_the_same_slot_drops_the_earlier_copy():
    bm = BlockManager(4, BS, host_blocks=1)
    computed(bm, list(range(100, 108)))
    computed(bm, list(range(200, 216)))  # two blocks of the first go to one slot in one step: the last one stays
    moves = bm.take_moves()
    assert len(moves.offload) == 1 and bm.num_offloaded == 2


def test_scheduler_admits_host_hits_without_recomputing_them():
    bm = BlockManager(6, BS, host_blocks=8)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=64)
    a = list(range(100, 116))
    computed(bm, a)
    computed(bm, list(range(200, 224)))  # 6 blocks: every block of a goes to the host
    bm.take_moves()
    c = seq(a + [1, 2, 3])
    sched.add(c)
    batch = sched.schedule()
    assert batch.seqs == [c] and batch.num_new_tokens == [3]
    assert len(bm.take_moves().restore) == 4


def test_without_a_host_pool_nothing_moves():
    bm = BlockManager(4, BS)
    a = list(range(100, 116))
    computed(bm, a)
    computed(bm, list(range(200, 216)))
    c = seq(a + [1])
    assert bm.match_host(c, bm.match_prefix(c)) == [] and bm.take_moves() is None

