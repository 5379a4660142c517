"""KV pools per layer kind (full / windowed) on tiny Gemma 2 and Gemma 3 models against transformers: greedy tokens
equal `generate` with prompts longer than the window under batching, chunked prefill, preemption, prefix reuse
(windowed blocks before the hit's window gone) and speculative rollback; the windowed pool's blocks in use stay
bounded on a long generation while the full pool grows; every block's refcount is back to 0 at the end; the full
pool admits more tokens than one shared pool in the same bytes."""
import pytest
import torch

from lowbit.serve import LLM, SamplingParams
from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.sequence import Sequence
from lowbit.serve.runner.kv_cache import bytes_per_block
from test_serve_gemma import PROMPTS, hf_greedy, save_tiny, tokens

torch.set_num_threads(1)
WINDOW, BS, CHUNK, BATCH = 12, 4, 8, 2  # the window of test_serve_gemma's SMALL config
PER_SEQ = -(-(WINDOW + CHUNK) // BS) + 2  # windowed blocks one running sequence may hold at most


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny(request.param, path)


def make_llm(path, **settings) -> LLM:
    return LLM(str(path), device="cpu", **{"block_size": BS, "max_num_tokens": CHUNK, "max_batch_size": BATCH,
                                           "num_kv_blocks": 64} | settings)


def check_released(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and not any(p.released for p in bm.pools)
    assert all(b.ref_count == 0 for p in bm.pools for b in p.blocks)


def test_two_pools_sized_from_one_budget(tiny):
    path, _ = tiny
    llm = make_llm(path)
    runner = llm.engine.runner
    assert runner.kv_windows == [None, WINDOW] and [m.kv_kind for m in runner.attn_layers] == [1, 0, 1]
    assert runner.kv_blocks == [64 * 3 - 2 * BATCH * PER_SEQ, BATCH * PER_SEQ]  # 3 layers, 2 windowed
    used = sum(m.kv_cache.nbytes for m in runner.attn_layers)
    assert used <= 64 * bytes_per_block(runner.attn_layers, BS, runner.kv_dtype)
    assert llm.engine.max_model_len == min(512, runner.kv_blocks[0] * BS) > 64 * BS  # one shared pool: 64 blocks
    gauges = llm.engine.gauges()
    assert gauges["lowbit_kv_window_blocks_total"][0] == BATCH * PER_SEQ
    assert gauges["lowbit_kv_blocks_total"][0] == sum(runner.kv_blocks)


def test_greedy_equals_hf_batched_and_chunked(tiny):
    path, model = tiny
    llm = make_llm(path)
    assert tokens(llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))) == \
        hf_greedy(model, PROMPTS)
    check_released(llm)


def test_long_generation_bounds_the_window_pool(tiny):
    path, model = tiny
    llm = make_llm(path)
    engine, prompt, n = llm.engine, PROMPTS[1][:20], 100
    engine.add_request("0", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    peak, out = [0, 0], None
    while engine.has_unfinished():
        for o in engine.step():
            out = o.outputs[0].token_ids if o.finished else out
        peak = [max(a, b) for a, b in zip(peak, engine.block_manager.used_blocks_by_kind())]
    assert out == hf_greedy(model, [prompt], n)[0]
    assert peak[1] <= PER_SEQ and peak[0] >= (len(prompt) + n - 1) // BS
    check_released(llm)


def test_preemption_keeps_hf_tokens(tiny):
    path, model = tiny
    prompts = [PROMPTS[2][i:i + 30] for i in range(3)]
    llm = make_llm(path, num_kv_blocks=12, max_batch_size=3, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == hf_greedy(model, prompts)
    check_released(llm)


def test_prefix_hit_past_released_window_blocks(tiny):
    """A's windowed blocks before its last window are handed to B; C (A's prompt and more) still reuses A's
    prefix: the full pool has every block, the windowed pool the ones C's queries read."""
    path, model = tiny
    llm = make_llm(path)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = PROMPTS[2][:40], [(5 * i + 1) % 1000 + 5 for i in range(16)]
    c = a + [901, 902, 903]
    llm.generate([a], greedy)
    llm.generate([b], greedy)
    bm = llm.engine.block_manager
    match = bm.match_prefix(Sequence(c, greedy))
    assert len(match) * BS >= 32 and match.skipped[1] > 0  # a hit with windowed placeholders
    hits = bm.num_hit_tokens
    assert tokens(llm.generate([c], greedy)) == hf_greedy(model, [c])
    assert bm.num_hit_tokens - hits == len(match) * BS
    check_released(llm)


def test_speculative_rollback_keeps_hf_tokens(tiny):
    path, model = tiny
    prompts = [[(37 * i) % 995 + 5 for i in range(300)], PROMPTS[2]]  # 300 distinct tokens: outputs recur
    llm = make_llm(path, speculative="ngram", speculative_adaptive=False,
                   num_draft_tokens=3, ngram_size=1, max_num_tokens=16)
    assert len(llm.engine.runner.kv_blocks) == 2
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert tokens(outs) == hf_greedy(model, prompts, 12)
    assert llm.engine.spec.num_drafted > llm.engine.spec.num_accepted  # some drafts rolled back
    check_released(llm)


def test_host_cache_falls_back_to_one_pool(tiny):
    path, model = tiny
    llm = make_llm(path, host_cache_size="1MiB")
    assert llm.engine.runner.kv_windows == [None] and len(llm.engine.runner.kv_blocks) == 1
    assert tokens(llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))) == \
        hf_greedy(model, PROMPTS)


def test_draft_model_falls_back_to_one_pool(tiny):
    path, model = tiny
    llm = make_llm(path, speculative="draft", speculative_adaptive=False, draft_model=str(path), num_draft_tokens=2)
    assert len(llm.engine.runner.kv_blocks) == 1 and llm.engine.spec.drafter.runner.kv_windows == [None]
    assert tokens(llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))) == \
        hf_greedy(model, PROMPTS)
    assert llm.engine.spec.num_accepted > 0  # the model drafts for itself


def _seq(n: int, start: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=1))


def test_block_manager_window_pool_limits_admission_and_growth():
    """Either pool running out refuses the allocation; the windowed pool gets blocks back as the window moves."""
    bm = BlockManager([32, 6], BS, sliding_window=[None, 8])
    s = _seq(16)
    assert not bm.can_allocate(s, bm.match_prefix(s), 28)  # 7 blocks: the full pool has them, the windowed not
    bm.allocate(s, bm.match_prefix(s), 16)
    assert [len(t) for t in s.block_tables] == [4, 4] and bm.used_blocks_by_kind() == [4, 4]
    s.num_computed_tokens = 16
    bm.commit(s)
    bm.release_outside_window(s)  # the query at 16 reads keys 9.. : blocks 0 and 1 are released
    assert bm.used_blocks_by_kind() == [4, 2] and bm.pools[1].released[s.seq_id][0] == 2
    assert bm.can_append(s, 16) and not bm.can_append(s, 20)
    bm.deallocate(s)
    assert bm.num_used_blocks == 0 and not bm.pools[1].released


def test_block_manager_prefix_match_skips_windowed_blocks_out_of_reach():
    bm = BlockManager([32, 8], BS, sliding_window=[None, 8])
    a = _seq(24)
    bm.allocate(a, bm.match_prefix(a), 24)
    a.num_computed_tokens = 24
    bm.commit(a)
    full, windowed = list(a.block_tables[0]), list(a.block_tables[1])
    bm.deallocate(a)
    pool = bm.pools[1]  # the windowed pool hands out a's blocks 0 and 1 (their hashes dropped)
    for block_id in windowed[:2]:
        del pool.free_block_ids[block_id]
        del pool.hash_to_block_id[pool.blocks[block_id].hash]
        pool.free_block_ids[block_id] = None
    c = _seq(30)
    m = bm.match_prefix(c)  # 6 blocks hit; the query at 24 reads keys 17.. : windowed blocks 4 and 5
    assert m == full[:6] and m.tables[1] == [0] * 4 + windowed[4:6] and m.skipped == [0, 4]
    bm.pools[1].hash_to_block_id.pop(bm.pools[1].blocks[windowed[4]].hash)
    m = bm.match_prefix(c)  # windowed block 4 gone too: 6 and 5 blocks need it; 4 blocks read blocks 2 and 3
    assert m == full[:4] and m.tables[1] == [0, 0] + windowed[2:4] and m.skipped == [0, 2]
    bm.allocate(c, m, c.num_tokens - len(m) * BS)
    c.num_computed_tokens = c.num_tokens
    bm.commit(c)  # the hash chain continues past the placeholders: c's blocks 4, 5 hash as a's did
    m = bm.match_prefix(_seq(30))
    assert m == full[:6] + c.block_table[6:7]  # a's full blocks 4 and 5 were still cached
    assert m.tables[1][5:] == c.block_tables[1][5:7]  # the windowed pool reused a's block 5 for c
    bm.deallocate(c)
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for p in bm.pools for b in p.blocks)
