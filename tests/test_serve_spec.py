"""Speculative decoding (n-gram drafts) on a tiny random model: greedy and seeded outputs equal decoding without it
through batching, chunked prefill, preemption, prefix reuse, overlapped steps, stop rules and logprobs; drafts get
accepted on repetitive text; the verifier's token law is the target's (chi-square); KV blocks all come back."""
import math

import pytest
import torch

from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.scheduler import Batch
from lowbit.serve.engine.sequence import Sequence
from lowbit.serve.runner.block_tables import BlockTables
from lowbit.serve.runner.sampler import Sampler, truncate
from lowbit.serve.spec.decoder import MAX_PAUSE, SpecDecoder
from lowbit.serve.spec.ngram import MIN_MATCH, NgramDrafter, NgramIndex, lookup
from lowbit.serve.spec.verify import emitted, verify
from test_serve_host_path import tiny_engine

torch.set_num_threads(1)
# a repeated pattern, a period-7 cycle, and a short prompt: the tiny model falls into loops that n-gram drafts follow
PROMPTS = [[5, 6, 7, 8, 9] * 6, [100 + i % 7 for i in range(30)], [1, 2, 3], [40, 41, 42, 40, 41]]
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


def generate(engine, prompts, params, stream=False):
    """Per prompt: (token ids, text, finish reason, logprobs) of its final output."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp, stream=stream)
    done, bs = {}, engine.config.block_size
    while engine.has_unfinished():
        outputs = engine.step()
        for seq in engine.scheduler.running:  # rejected drafts' blocks went back: none past the sequence's tokens
            assert len(seq.block_table) <= -(-seq.num_tokens // bs)
        for out in outputs:
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.text, c.finish_reason, c.logprobs)
    return [done[f"r{i}"] for i in range(len(prompts))]


def assert_same(plain, spec, logprob_tol=1e-4):
    for (ids_a, text_a, reason_a, lp_a), (ids_b, text_b, reason_b, lp_b) in zip(plain, spec):
        assert ids_b == ids_a and text_b == text_a and reason_b == reason_a
        assert (lp_a is None) == (lp_b is None)
        for (c_a, top_a), (c_b, top_b) in zip(lp_a or [], lp_b or []):
            assert abs(c_a - c_b) < logprob_tol
            assert [i for i, _ in top_a] == [i for i, _ in top_b]


@pytest.mark.parametrize("settings", [
    dict(num_kv_blocks=96),  # plain continuous batching
    dict(num_kv_blocks=96, max_num_tokens=7),  # chunked prefill, and the verify budget
    dict(num_kv_blocks=30, enable_prefix_caching=False),  # preemption (4 x ~80 tokens in 120 slots)
    dict(num_kv_blocks=96, overlap_steps=True),  # overlapped steps around the verify steps
], ids=["batch", "chunked", "preempt", "overlap"])
def test_greedy_outputs_equal_plain_decoding_and_drafts_are_accepted(settings):
    plain = generate(tiny_engine(**settings), PROMPTS, GREEDY)
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False,
                         num_draft_tokens=4, ngram_size=1, **settings)  # one-token matches:
    spec = generate(engine, PROMPTS, GREEDY)  # the most drafts, and rejections
    assert_same(plain, spec)
    assert engine.spec.num_steps > 0 and engine.spec.num_accepted > 0
    assert engine.spec.num_accepted < engine.spec.num_drafted  # rejections were rolled back too
    assert engine.block_manager.num_used_blocks == 0
    if settings.get("num_kv_blocks") == 30:
        assert engine.scheduler.num_preemptions > 0


def test_steps_without_drafts_are_launched_overlapped_and_outputs_still_equal():
    """n = 3 (matches of 2+ tokens): some steps find no draft; with overlapped steps they are launched like plain
    decode steps (their tokens resolved at the next step) and the outputs stay those of plain decoding."""
    settings = dict(num_kv_blocks=96, overlap_steps=True)
    plain = generate(tiny_engine(**settings), PROMPTS, GREEDY)
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False, num_draft_tokens=4, **settings)
    step, launched = engine.spec.step, []

    def counted(eng, batch):
        out = step(eng, batch)
        launched.append(eng.in_flight is not None)
        return out
    engine.spec.step = counted
    assert_same(plain, generate(engine, PROMPTS, GREEDY))
    assert any(launched) and engine.spec.num_steps > 0 and engine.block_manager.num_used_blocks == 0


def test_prefix_reuse_after_verify_steps_keeps_outputs():
    """A second round finds the first round's blocks (prompt + accepted tokens); rejected drafts were never hashed,
    so the reused prefixes give the same tokens as a fresh engine without speculation."""
    plain = generate(tiny_engine(num_kv_blocks=96), PROMPTS, GREEDY)
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False, num_kv_blocks=96)
    first = generate(engine, PROMPTS, GREEDY)
    extended = [p + ids[:20] for p, (ids, *_) in zip(PROMPTS, first)]  # prompts whose heads were generated
    hits = engine.block_manager.num_hit_tokens
    again = generate(engine, extended, GREEDY)
    assert engine.block_manager.num_hit_tokens - hits >= 4 * 16  # blocks holding generated tokens were found
    assert_same(plain, first)
    assert_same(generate(tiny_engine(num_kv_blocks=96), extended, GREEDY), again)
    assert engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_stop_rules_and_logprobs_equal_plain_decoding():
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=1, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=5, top_p=0.9, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=0),  # max_tokens mid-draft
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=["dn"], stop_token_ids=[202])]
    plain = generate(tiny_engine(num_kv_blocks=96), PROMPTS, params)
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False, num_draft_tokens=3, num_kv_blocks=96)
    spec = generate(engine, PROMPTS, params, stream=True)
    assert_same(plain, spec)
    assert len(spec[2][0]) == 9 and spec[2][2] == "length"
    assert engine.spec.num_accepted > 0 and engine.block_manager.num_used_blocks == 0


def test_auto_off_above_the_batch_threshold():
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False,
                         speculative_max_batch_size=2, num_kv_blocks=96)
    plain = generate(tiny_engine(num_kv_blocks=96), PROMPTS[:3], GREEDY)
    assert_same(plain, generate(engine, PROMPTS[:3], GREEDY))  # same length: all three decode together
    assert engine.spec.num_steps == 0
    generate(engine, PROMPTS[:1], GREEDY)
    assert engine.spec.num_steps > 0


def test_metrics_report_drafted_and_accepted_tokens():
    engine = tiny_engine(speculative="ngram", speculative_adaptive=False, num_kv_blocks=96)
    generate(engine, PROMPTS, GREEDY)
    text = engine.metrics.render(engine.gauges())
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("lowbit_spec")}
    assert values["lowbit_spec_draft_tokens_total"] == engine.spec.num_drafted > 0
    assert values["lowbit_spec_accepted_tokens_total"] == engine.spec.num_accepted > 0
    assert values["lowbit_spec_acceptance_rate"] == pytest.approx(engine.spec.num_accepted / engine.spec.num_drafted,
                                                                  rel=1e-5)
    assert values["lowbit_spec_accepted_tokens_mean"] > 0


def test_verifier_draws_tokens_from_the_target_distribution():
    """One drafted token t: over many seeds the emitted first token follows softmax(logits / T) truncated (top-k),
    t is accepted with frequency p(t), and after a rejection the token follows p without t (chi-square, p > 1e-3)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 12, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8)
    p = truncate(logits[:1] / 0.8, [8], [1.0]).softmax(-1)[0]
    t = int(p.argsort(descending=True)[1])  # a likely but not the likeliest token
    n = 6000
    results = verify(Sampler(), logits.repeat(n, 1), [[t]] * n, [params] * n, list(range(n)), [10] * n)
    first = torch.tensor([tokens[0] for tokens, _ in results])
    counts = torch.bincount(first, minlength=12).double()
    assert _chi_square_ok(counts, p.double())
    accepted = sum(len(tokens) == 2 for tokens, _ in results)
    assert abs(accepted / n - p[t].item()) < 4 * math.sqrt(p[t].item() * (1 - p[t].item()) / n)
    rejected = counts.clone()
    rejected[t] = 0
    residual = p.double().clone()
    residual[t] = 0
    assert _chi_square_ok(rejected, residual / residual.sum())


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square over the cells the law gives mass (no count may fall where it gives none); the statistic
    against the 0.999 quantile (Wilson-Hilferty)."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return False
    n, expected = counts.sum(), probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    quantile = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return n > 0 and stat < quantile


def test_emitted_takes_the_agreeing_prefix_and_the_targets_next_token():
    assert emitted([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert emitted([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]
    assert emitted([4], [3, 8]) == [3]
    assert emitted([], [7]) == [7]


def test_ngram_lookup_copies_after_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 2) == [7, 1]  # the most recent occurrence
    assert lookup([5, 2, 3, 8, 4, 2, 3], 3, 4) == [8, 4, 2, 3]  # the 2-gram "2 3": 3-gram "4 2 3" never occurred
    assert lookup([1, 2, 3, 4], 2, 3) == []
    assert lookup([7, 7, 7], 3, 3) == [7]  # the 2-gram "7 7"
    assert lookup([7, 7], 3, 3) == [] and lookup([7, 7], 1, 3) == [7]  # one-token matches only when n is 1
    assert lookup([7], 3, 3) == []


def brute_force_lookup(ids: list[int], n: int, k: int) -> list[int]:
    """The definition, scanned from scratch: the longest suffix (n..MIN_MATCH tokens, 1 when n is) with an earlier
    occurrence that a token follows, its most recent one, the k tokens after it."""
    for m in range(min(n, len(ids) - 1), min(n, MIN_MATCH) - 1, -1):
        for e in range(len(ids) - 2, m - 2, -1):
            if ids[e + 1 - m:e + 1] == ids[len(ids) - m:]:
                return ids[e + 1:e + 1 + k]
    return []


def test_incremental_ngram_index_equals_a_scan_of_the_whole_history():
    """One index kept across a growing history (1-3 tokens appended between lookups, as verify steps append them)
    proposes what a scan of the whole history proposes, at every step."""
    gen = torch.Generator().manual_seed(0)
    for n, vocab in [(3, 4), (2, 9), (1, 3), (4, 6)]:
        ids, index = torch.randint(0, vocab, (5,), generator=gen).tolist(), NgramIndex(n)
        for step in range(150):
            k = step % 5 + 1
            assert index.propose(ids, k) == brute_force_lookup(ids, n, k), (n, vocab, step)
            ids += torch.randint(0, vocab, (step % 3 + 1,), generator=gen).tolist()


def test_a_sequence_whose_drafts_miss_pauses_drafting_for_doubling_spans():
    dec = SpecDecoder(NgramDrafter(3), EngineConfig(speculative="ngram", speculative_adaptive=False,
                                                    num_draft_tokens=8))
    seq = Sequence(list(range(20)), SamplingParams())
    seq.num_computed_tokens = 19  # a decode: its newest token is uncomputed

    def step(drafted, accepted):  # what SpecDecoder.step does around _pace: the sequence gains accepted + 1 tokens
        dec._pace(seq, drafted, accepted)
        seq.token_ids += [0] * (accepted + 1)
        seq.num_computed_tokens = seq.num_tokens - 1

    step(8, 2)
    assert dec.applies(Batch([seq], [1]))  # a partial acceptance: no pause
    pauses = []
    for _ in range(7):  # misses: pauses of 1, 2, 4 ... MAX_PAUSE tokens of plain decoding
        step(8, 0)
        n = 0
        while not dec.applies(Batch([seq], [1])):
            seq.token_ids.append(0)
            seq.num_computed_tokens += 1
            n += 1
        pauses.append(n)
    assert pauses == [1, 2, 4, 8, 16, 16, 16] and MAX_PAUSE == 16
    step(8, 1)  # a hit ends the pausing
    assert seq.seq_id not in dec.pauses
    step(8, 0)
    assert dec.pauses[seq.seq_id][1] == 1
    dec.release(seq)
    assert not dec.pauses


def test_truncate_gives_back_rejected_blocks_and_keeps_refcounts():
    bm = BlockManager(8, block_size=4)
    a = Sequence(list(range(10)), SamplingParams())
    bm.allocate(a, [], 10)
    a.num_computed_tokens = 10
    bm.commit(a)  # two full blocks hashed
    b = Sequence(list(range(10)), SamplingParams())
    matched = bm.match_prefix(b)
    bm.allocate(b, matched, 2)
    bm.append(a, 7)  # room for 7 drafted tokens: 17 tokens -> 5 blocks
    assert len(a.block_table) == 5 and bm.num_used_blocks == 6
    tables = BlockTables(2, 4)
    tables.gather([a])  # the runner caches a's row
    bm.truncate(a, 12)  # 2 accepted: 12 tokens -> 3 blocks
    assert len(a.block_table) == 3 and bm.num_used_blocks == 4
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.append(a, 5)  # regrown with another block: the cached row is rewritten
    assert tables.gather([a])[0, :len(a.block_table)].tolist() == a.block_table
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_used_blocks == 0 and all(blk.ref_count == 0 for blk in bm.blocks)


@pytest.mark.parametrize("settings, message", [
    (dict(speculative="ngram", num_draft_tokens=0), "num_draft_tokens must be an integer >= 1, got 0"),
    (dict(speculative="ngram", ngram_size=-1), "ngram_size must be an integer >= 1"),
    (dict(speculative="eagle"), "speculative must be ngram, draft or none, got 'eagle'"),
    (dict(speculative="draft"), "speculative: draft needs draft_model"),
    (dict(draft_model="x"), "draft_model 'x' is set but speculative is None"),
    (dict(speculative="ngram", speculative_max_batch_size=0), "speculative_max_batch_size must be"),
])
def test_bad_speculative_settings_fail_with_one_line(settings, message):
    with pytest.raises(ValueError, match=message) as e:
        EngineConfig(**settings)
    assert "\n" not in str(e.value)
