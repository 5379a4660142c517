"""The speculation policy (spec/policy.py): per decode batch-size bucket it speculates only while measured verify steps
emit more tokens per second than plain steps, re-probes after a doubling back-off, and switching mid-generation keeps
greedy outputs those of plain decoding. Costs come from an injected clock (deterministic)."""
import json

import pytest
import torch

from lowbit.bench_cli import load
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.spec import policy as pol
from lowbit.serve.spec.decoder import SpecDecoder
from lowbit.serve.spec.ngram import NgramDrafter
from lowbit.serve.spec.policy import SpecPolicy, bucket_label, bucket_of
from lowbit.serve.engine.engine import Engine
from lowbit.testing.dummy_weights import dummy_checkpoint
from test_serve_host_path import TINY, CharTokenizer, tiny_engine
from test_serve_spec import GREEDY, PROMPTS, generate

torch.set_num_threads(1)
# ms per step and tokens per verify step, after the H200 runs of the embedded fp8 checkpoint (docs/performance.md)
PLAIN_MS, VERIFY_MS = 1.07, 3.34
K = 8  # drafted tokens per sequence and step


def simulate(policy: SpecPolicy, batch: int, verify_tokens, steps: int, start: int = 0, verify_ms=VERIFY_MS,
             plain_ms=PLAIN_MS):
    """Runs `steps` decode steps of `batch` sequences; a verify step emits verify_tokens(step) tokens in verify_ms,
    a plain step batch tokens in plain_ms. Returns (tokens/ms, per step whether it verified)."""
    tokens, ms, verified = 0, 0.0, []
    for step in range(start, start + steps):
        v = policy.speculate(batch)
        n, t = (verify_tokens(step), verify_ms) if v else (batch, plain_ms)
        policy.record(batch, v, n, t / 1e3, verified=v)
        tokens, ms = tokens + n, ms + t
        verified.append(v)
    return tokens / ms, verified


def test_buckets_group_batch_sizes_by_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [bucket_label(i) for i in range(5)] == ["1", "2", "3-4", "5-8", "9-16"]


def test_verify_steps_that_do_not_pay_turn_speculation_off_and_throughput_stays_at_plain():
    """Batch 16 of chat: a verify step emits 19 tokens (a few sequences accept drafts) in 3.1x a plain step's time:
    0.57x plain when always speculating. The policy measures, stops, and keeps >= 0.98x plain over 2,000 steps."""
    policy = SpecPolicy(K)
    rate, verified = simulate(policy, 16, lambda step: 19, 2000)
    plain = 16 / PLAIN_MS
    assert rate >= 0.98 * plain
    assert 2 <= sum(verified) <= 24  # the first measurements and probes at doubling intervals only
    assert verified[:pol.WARM + 1] == [False] * (pol.WARM + 1)  # plain steps measured first
    assert policy.gauges()['lowbit_spec_speculating{batch="9-16"}'][0] == 0.0
    assert policy.gauges()['lowbit_spec_gain{batch="9-16"}'][0] == pytest.approx(19 / VERIFY_MS / plain)


def probes_and_gaps(verified: list[bool]) -> tuple[list[int], list[int]]:
    """Where each probe starts (one step unmeasured, then PROBE) after the first verify steps, and the plain steps
    between probes."""
    steps = [i for i, v in enumerate(verified) if v][pol.WARM + 1:]
    probes = [i for i in steps if i - 1 not in steps]
    assert all(i + j in steps for i in probes for j in range(1 + pol.PROBE))
    return probes, [b - a - 1 - pol.PROBE for a, b in zip(probes, probes[1:])]


def test_probes_come_after_doubling_back_offs():
    """Batch 4, 5 tokens per verify step (0.4x plain, but a verify step costs less than the k + 1 plain steps
    whose tokens it could emit): the waits double from the minimum back-off up to the maximum."""
    policy = SpecPolicy(K)
    _, verified = simulate(policy, 4, lambda step: 5, 5000)
    probes, gaps = probes_and_gaps(verified)
    assert probes[0] - 2 * (pol.WARM + 1) == pol.MIN_BACKOFF  # plain, then verify warm-up steps, then the wait
    assert gaps[:6] == [2 * pol.MIN_BACKOFF, 4 * pol.MIN_BACKOFF, 8 * pol.MIN_BACKOFF, 16 * pol.MIN_BACKOFF,
                        pol.MAX_BACKOFF, pol.MAX_BACKOFF]


def test_where_no_workload_can_pay_the_probes_wait_the_longest():
    """Batch 64 as on the H200 (plain 1.31 ms, a verify step of every sequence 17.7 ms > (k + 1) x 1.31 ms):
    even with every draft accepted a verify step would lose, so after the first measurement the next probe waits
    the longest back-off, and throughput stays within 2 % of plain over 4,000 steps."""
    policy = SpecPolicy(K)
    rate, verified = simulate(policy, 64, lambda step: 64 * (K + 1), 4000, verify_ms=17.7, plain_ms=1.31)
    probes, _ = probes_and_gaps(verified)
    assert probes[0] - 2 * (pol.WARM + 1) == pol.MAX_BACKOFF
    assert rate >= 0.98 * 64 / 1.31


def test_a_larger_batch_above_a_losing_one_starts_off_and_probes_after_its_back_off():
    """Chat at batch 4 loses, then the batch grows to 16: no verify step at 16 until the smaller bucket's back-off
    has passed, then probes after doubling back-offs; throughput there stays within 3 % of plain."""
    policy = SpecPolicy(K)
    simulate(policy, 4, lambda step: 5, 200)
    backoff = policy.buckets[bucket_of(4)].backoff
    rate, verified = simulate(policy, 16, lambda step: 19, 3000)
    assert not any(verified[:backoff]) and verified[backoff]
    assert rate >= 0.97 * 16 / PLAIN_MS


def test_high_acceptance_keeps_speculating():
    """Batch 1 quoting: 8.8 tokens per verify step in 3.1x the time of a plain step (~2.5x plain); plain steps only
    where the plain rate is re-measured (1 + PROBE steps after 32, 64, 128, ... verify steps)."""
    policy = SpecPolicy(K)
    rate, verified = simulate(policy, 1, lambda step: 8.8, 1000)
    plain_steps = [i for i, v in enumerate(verified) if not v][pol.WARM + 1:]
    assert len(plain_steps) == 4 * (1 + pol.PROBE)  # 1000 steps hold 32 + 64 + 128 + 256 + 3 x 4 and less than 1024
    first = 2 * (pol.WARM + 1) + pol.MIN_BACKOFF  # plain and verify warm-ups, then 32 verify steps
    assert plain_steps[:1 + pol.PROBE] == list(range(first, first + 1 + pol.PROBE))
    assert rate >= 0.98 * 8.8 / VERIFY_MS
    assert policy.gauges()['lowbit_spec_speculating{batch="1"}'][0] == 1.0


def test_a_stale_plain_rate_is_re_measured_while_speculating():
    """Plain steps measured slow at first (3x their cost: the first steps after a large prefill, say) make a losing
    speculation look paying; the first re-measure of plain turns it off."""
    policy = SpecPolicy(K)
    for _ in range(pol.WARM + 1):
        policy.record(16, False, 16, 3 * PLAIN_MS / 1e3)
    rate, verified = simulate(policy, 16, lambda step: 19, 2000)
    on = pol.WARM + 1 + pol.MIN_BACKOFF  # verify warm-up, then 32 verify steps before plain is re-measured
    assert all(verified[:on]) and not any(verified[on:on + 1 + pol.PROBE + pol.MIN_BACKOFF])  # then off
    assert rate >= 0.9 * 16 / PLAIN_MS


def test_a_workload_that_turns_to_quoting_gets_speculation_back_at_the_next_probe():
    policy = SpecPolicy(K)
    _, chat = simulate(policy, 8, lambda step: 9, 300)  # ~0.4x plain: off
    assert not any(chat[-pol.MIN_BACKOFF:])
    backoff = policy.buckets[bucket_of(8)].backoff
    _, quote = simulate(policy, 8, lambda step: 8 * 8.8, 1000, start=300)  # ~2x plain
    first = quote.index(True)
    assert first <= backoff and sum(quote[first:]) >= len(quote[first:]) - 4 * (1 + pol.PROBE)  # but re-measures


def test_a_stall_is_not_measured():
    """A step 10x slower than its kind's average (a first compile at a new shape, a GC pause) leaves the averages."""
    policy = SpecPolicy(K)
    simulate(policy, 1, lambda step: 8.8, 20)
    b = policy.buckets[0]
    before = (b.spec.tokens, b.spec.seconds)
    policy.record(1, True, 9, 50 * VERIFY_MS / 1e3)
    assert (b.spec.tokens, b.spec.seconds) == before and b.on


def test_steps_are_timed_by_mode_and_overlapped_launches_without_a_step_in_flight_are_not():
    """The policy compares modes: a step it let speculate counts as speculating whether it verified or found no
    draft. Overlapped, a plain step launched with nothing in flight (after a verify step) is not measured: its wall
    time is a launch, its device time shows in the next step's wait."""
    now = [0.0]
    dec = SpecDecoder(NgramDrafter(3), EngineConfig(speculative="ngram"), clock=lambda: now[0])
    bucket = dec.policy.buckets.setdefault(0, pol.Bucket())

    def step(on, emitted, seconds, steady=True):
        dec.on, dec.emitted, started = on, emitted, now[0]
        now[0] += seconds
        dec.timed(1, started, steady)

    step(False, None, 0.1, steady=False)  # a launch only
    assert bucket.plain.skip == 1 and bucket.plain.n == 0  # not even the warm-up step counted
    for _ in range(3):  # steady plain steps, 1 s each (the first not measured)
        step(False, None, 1.0)
    assert bucket.plain.n == 2 and bucket.plain.seconds == pytest.approx(1.0)
    step(True, 9, 3.0)  # not measured: the first
    step(True, 9, 3.0)
    step(True, None, 1.0)  # speculating, no draft found: 1 token
    assert bucket.spec.n == 2 and bucket.spec.tokens == pytest.approx(9 + 0.25 * (1 - 9))
    assert bucket.spec.seconds == pytest.approx(3.0 + 0.25 * (1.0 - 3.0))
    assert list(dec.recent) == [False] * 4 + [True, True, False]


def long_engine(**config) -> Engine:
    """tiny_engine's model with a context of 1,024 tokens."""
    ckpt = dummy_checkpoint("bf16", dict(TINY, max_position_embeddings=1024), device="cpu")
    cfg = dict(max_batch_size=4, block_size=4, device="cpu", dtype="float32")
    return Engine(ckpt.path, EngineConfig(**cfg | config), ckpt=ckpt, tokenizer=CharTokenizer())


class SimulatedDevice:
    """The tiny engine's forward on a simulated clock: plain steps cost 1, multi-token steps `verify_cost`."""

    def __init__(self, engine):
        self.now, self.verify_cost, self.forward = 0.0, 1.0, engine.runner.run
        engine.runner.run = self.run
        engine.spec.clock = lambda: self.now

    def run(self, batch, rows, pending=None):
        self.now += 1.0 if all(n == 1 for n in batch.num_new_tokens) else self.verify_cost
        return self.forward(batch, rows, pending)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_equal_plain_decoding_while_the_policy_switches(overlap, monkeypatch):
    """Verify steps cost 1.2 plain steps (speculation pays on the tiny model's loops once they start), then 8 (off),
    then 1.2 again (a probe turns it back on): outputs equal plain decoding's; each phase decided as its costs say.
    Back-offs from 8 steps up to 32 (32 and 1,024 by default) keep the run short."""
    monkeypatch.setattr(pol, "MIN_BACKOFF", 8)
    monkeypatch.setattr(pol, "MAX_BACKOFF", 32)  # a verify step at 8x a plain one can never pay (k = 4): the longest
    settings = dict(num_kv_blocks=700, max_num_tokens=64, overlap_steps=overlap)
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    plain = generate(long_engine(**settings), PROMPTS, params)
    engine = long_engine(speculative="ngram", num_draft_tokens=4, ngram_size=1, **settings)
    device, decisions, timed = SimulatedDevice(engine), [], engine.spec.timed

    def record(batch_size, started, steady):
        if batch_size == len(PROMPTS):  # the phases: decode steps of the whole batch
            decisions.append(engine.spec.emitted is not None)
        timed(batch_size, started, steady)
        device.verify_cost = 8.0 if 60 <= len(decisions) < 120 else 1.2

    engine.spec.timed = record
    spec = generate(engine, PROMPTS, params)
    assert spec == plain
    assert sum(decisions[:60]) >= 5  # cheap: speculating once drafts come
    assert sum(decisions[60:120]) <= 3 + 3 * (1 + pol.PROBE)  # expensive: the average turns within 3 steps, then
    # probes only (after 8, 16, 32 plain steps)
    assert sum(decisions[120:]) >= 5 and len(decisions) > 150  # cheap again: a probe won
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_default_policy_on_the_wall_clock_keeps_outputs(overlap):
    """The engine as configured by default (policy on, perf_counter): whatever it decides, outputs are plain's."""
    settings = dict(num_kv_blocks=300, max_num_tokens=64, overlap_steps=overlap)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    plain = generate(long_engine(**settings), PROMPTS, params)
    engine = long_engine(speculative="ngram", num_draft_tokens=4, ngram_size=1, **settings)
    assert generate(engine, PROMPTS, params) == plain
    assert engine.spec.policy.buckets and len(engine.spec.recent) > 0
    assert engine.block_manager.num_used_blocks == 0


def test_metrics_show_the_enabled_fraction_and_each_bucket_once_described():
    engine = tiny_engine(speculative="ngram", num_draft_tokens=4, ngram_size=1, num_kv_blocks=96)
    SimulatedDevice(engine)
    generate(engine, PROMPTS, GREEDY)
    text = engine.metrics.render(engine.gauges())
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("lowbit_spec")}
    steps = engine.spec.recent
    assert values["lowbit_spec_enabled_fraction"] == pytest.approx(sum(steps) / len(steps)) and 0 < sum(steps)
    assert 'lowbit_spec_speculating{batch="3-4"}' in values and 'lowbit_spec_gain{batch="3-4"}' in values
    assert text.count("# HELP lowbit_spec_speculating ") == 1 and text.count("# TYPE lowbit_spec_gain gauge") == 1


def test_host_only_bench_with_h200_step_costs_keeps_chat_at_plain_and_quote_fast(tmp_path):
    """`lowbit bench spec --host-only --step-costs h200`: at batch 16 the chat script without the policy runs well
    below plain (as measured on the H200); with the (warm) policy within 3 % of plain; quoting keeps its speed-up."""
    out = tmp_path / "spec.jsonl"
    argv = ["--host-only", "--step-costs", "h200", "--tps-batch-sizes", "16", "--repeats", "1", "--json", str(out)]
    assert load("spec").main(argv) == 0
    rows = {r["workload"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["chat"]["no_policy_speedup"] < 0.8 and rows["chat"]["speedup"] >= 0.97
    assert rows["quote"]["speedup"] >= 2.0 and rows["quote"]["no_policy_speedup"] >= 2.0
    assert all(r["identical_outputs"] for r in rows.values())
