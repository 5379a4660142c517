"""BlockManager and Scheduler without torch or a model: allocation, prefix reuse, chunking, preemption, FCFS."""
from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.scheduler import Scheduler
from lowbit.serve.engine.sequence import Sequence, SequenceStatus

BS = 16


def seq(n, start=0, **params):
    return Sequence(list(range(start, start + n)), SamplingParams(**params))


def run_step(sched, sampled_token=7):
    """Schedules one step and pretends the model ran: computed tokens advance, finished prefills get a token."""
    batch = sched.schedule()
    if batch is None:
        return None
    sched.update(batch)
    for s in batch.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(sampled_token)
    return batch


def test_allocate_and_free_all_blocks():
    bm = BlockManager(8, BS)
    s = seq(40)
    assert bm.can_allocate(s, [], 40)
    bm.allocate(s, [], 40)
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3
    s.num_computed_tokens = 40
    s.append_token(1)
    assert bm.can_append(s, 1)
    bm.append(s, 1)
    assert len(s.block_table) == 3  # token 41 still fits in block 3
    bm.deallocate(s)
    assert bm.num_used_blocks == 0 and s.block_table == []


def test_prefix_reuse_only_after_commit_and_never_the_last_block():
    bm = BlockManager(16, BS)
    a = seq(48)
    bm.allocate(a, [], 48)
    b = seq(48)
    assert bm.match_prefix(b) == []  # computed K/V not yet committed
    a.num_computed_tokens = 48
    bm.commit(a)
    assert bm.match_prefix(b) == a.block_table[:2]  # the block with b's last token is always recomputed
    c = seq(49)
    assert bm.match_prefix(c) == a.block_table[:3]
    d = Sequence(list(range(16)) + [999] * 33, SamplingParams())
    assert bm.match_prefix(d) == a.block_table[:1]  # the chain breaks at the first different block
    bm.allocate(c, bm.match_prefix(c), 1)
    assert c.num_computed_tokens == 48 and bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.num_hit_tokens == 48


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(4, BS)
    a = seq(33)
    bm.allocate(a, [], 33)
    a.num_computed_tokens = 33
    bm.commit(a)
    bm.deallocate(a)
    b = seq(33)
    matched = bm.match_prefix(b)
    assert len(matched) == 2 and bm.can_allocate(b, matched, 1)
    bm.allocate(b, matched, 1)
    assert bm.num_used_blocks == 3
    assert bm.match_prefix(seq(40, start=500)) == []


def test_prefix_caching_switch_and_prompt_logprobs_disable_reuse():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(40)
    bm.allocate(a, [], 40)
    a.num_computed_tokens = 40
    bm.commit(a)
    assert bm.match_prefix(seq(40)) == []
    bm2 = BlockManager(8, BS)
    bm2.allocate(a2 := seq(40), [], 40)
    a2.num_computed_tokens = 40
    bm2.commit(a2)
    assert bm2.match_prefix(seq(40, prompt_logprobs=0)) == []


def test_chunked_prefill_respects_token_budget_and_batch_size():
    sched = Scheduler(BlockManager(64, BS), max_batch_size=2, max_num_tokens=10)
    seqs = [seq(25, start=100 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plans = []
    while any(s.num_completion_tokens == 0 for s in seqs[:2]):
        b = run_step(sched)
        assert b.num_tokens <= 10
        plans.append([(s.seq_id, n) for s, n in zip(b.seqs, b.num_new_tokens)])
    assert plans[0] == [(seqs[0].seq_id, 10)]
    assert plans[2] == [(seqs[0].seq_id, 5), (seqs[1].seq_id, 5)]
    assert len(sched.running) == 2 and seqs[2].status == SequenceStatus.WAITING  # batch size 2
    b = sched.schedule()
    assert b.is_decode and b.num_new_tokens == [1, 1]


def test_decodes_go_before_prefill_chunks():
    sched = Scheduler(BlockManager(64, BS), max_batch_size=4, max_num_tokens=10)
    young = seq(4, start=500)
    old = seq(100)
    sched.add(young)
    run_step(sched)  # young: prompt computed, first token sampled
    sched.running.insert(0, old)  # an older sequence still in its prefill
    sched.block_manager.allocate(old, [], 0)
    old.status = SequenceStatus.RUNNING
    b = sched.schedule()
    assert list(zip(b.seqs, b.num_new_tokens)) == [(young, 1), (old, 9)]


def test_decode_batch_is_decode():
    sched = Scheduler(BlockManager(64, BS), max_batch_size=4, max_num_tokens=64)
    for i in range(3):
        sched.add(seq(5, start=10 * i))
    run_step(sched)
    b = sched.schedule()
    assert b.is_decode and b.num_new_tokens == [1, 1, 1]


def test_preemption_frees_the_youngest_and_requeues_it_first():
    sched = Scheduler(BlockManager(4, BS), max_batch_size=4, max_num_tokens=256)
    old, young = seq(31), seq(16, start=50)
    sched.add(old)
    sched.add(young)
    run_step(sched)  # old: 2 blocks, young: 1 block + 1 block for its sampled token next step
    assert sched.block_manager.num_used_blocks == 3
    run_step(sched)  # old decodes into its block 2 (token 32 -> block index 1), young needs a 2nd block: fits
    for _ in range(16):
        run_step(sched)  # old needs a 3rd block at token 33: young gets preempted
    assert young.num_preemptions >= 1 and old.status == SequenceStatus.RUNNING
    assert sched.waiting[0] is young and young.block_table == [] and young.num_computed_tokens == 0
    sched.finish(old, "stop")
    b = run_step(sched)
    # recompute: the whole history, less the full block it finds again in the prefix cache
    assert b.seqs == [young] and young.num_cached_tokens == 16
    assert b.num_new_tokens == [young.num_tokens - 1 - 16]


def test_finish_and_abort_free_blocks():
    sched = Scheduler(BlockManager(8, BS), max_batch_size=4, max_num_tokens=64)
    a, b = seq(20), seq(20, start=40)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, "abort")
    sched.finish(b, "stop")
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work()
    c = seq(5)
    sched.add(c)
    sched.finish(c, "abort")  # still waiting
    assert not sched.has_work()


def simulate(requests, num_blocks, max_batch_size, max_num_tokens, prefix_caching, seed=0):
    """Runs requests [(arrival step, prompt, max_tokens)] through a Scheduler with a fake model whose K/V cache is a
    dict slot -> token id. Each step writes the new tokens' slots, then every sequence reads its whole context back
    through its block table (as attention does) and must find exactly its own tokens; the next token is a function
    of what it read. Returns the completions, in request order."""
    import random

    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, prefix_caching)
    sched = Scheduler(bm, max_batch_size, max_num_tokens)
    kv: dict[int, int] = {}
    seqs = [Sequence(prompt, SamplingParams(max_tokens=m)) for _, prompt, m in requests]
    step = 0
    while step <= max(a for a, _, _ in requests) or sched.has_work():
        for (arrival, _, _), s in zip(requests, seqs):
            if arrival == step:
                sched.add(s)
        step += 1
        batch = sched.schedule()
        if batch is None:
            continue
        assert batch.num_tokens <= max_num_tokens and len(batch.seqs) <= max_batch_size
        slot = lambda s, p: s.block_table[p // BS] * BS + p % BS  # noqa: E731
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                assert bm.blocks[s.block_table[p // BS]].ref_count == 1  # never write a shared block
                kv[slot(s, p)] = s.token_ids[p]
        contexts = [[kv[slot(s, p)] for p in range(s.num_computed_tokens + n)]
                    for s, n in zip(batch.seqs, batch.num_new_tokens)]
        sched.update(batch)
        for s, history in zip(batch.seqs, contexts):
            assert history == s.token_ids[:len(history)]
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(sum(i * t for i, t in enumerate(history)) % 97 + 3)
                if s.num_completion_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
        if rng.random() < 0.02 and sched.running:  # an abort now and then
            victim = rng.choice(sched.running)
            sched.finish(victim, "abort")
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)
    return [s.completion_token_ids if s.finish_reason == "length" else None for s in seqs], sched


def test_random_workload_same_outputs_under_any_cut():
    import random

    rng = random.Random(1)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(10, 40))] for _ in range(3)]
    requests = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        requests.append((rng.randint(0, 60), prompt, rng.randint(1, 20)))
    reference, _ = simulate(requests, 1000, 64, 10_000, prefix_caching=False, seed=7)
    tight, sched = simulate(requests, 8, 6, 13, prefix_caching=True, seed=7)
    assert sched.num_preemptions > 0 and sched.block_manager.num_hit_tokens > 0
    both = [(a, b) for a, b in zip(reference, tight) if a is not None and b is not None]
    assert len(both) > 20 and all(a == b for a, b in both)
