"""One speculative step of the engine: draft, verify in one forward over the paged KV, emit, roll back the rest."""
import time
from collections import deque

from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.scheduler import Batch
from lowbit.serve.engine.sequence import Sequence
from lowbit.serve.spec.policy import SpecPolicy
from lowbit.serve.spec.verify import verify

MAX_PAUSE = 16  # tokens: the longest a sequence whose drafts keep missing decodes without drafting
WINDOW = 256  # pure-decode steps lowbit_spec_enabled_fraction looks back over


class SpecDecoder:
    """Owns the drafter, the policy and the acceptance counters; `Engine.step` asks it whether a pure-decode batch
    speculates (`speculates`), runs it (`step`) and reports the step's wall time (`timed`)."""

    def __init__(self, drafter, config: EngineConfig, pausing: bool = True, adaptive: bool = True,
                 clock=time.perf_counter):
        """pausing: a sequence whose drafts miss pauses drafting (`_pace`); False: never (benchmarks). adaptive: a
        batch-size bucket where verify steps emit fewer tokens per second than plain steps decodes plain
        (`policy.SpecPolicy`); False: every step that `applies` verifies (benchmarks, tests of the verify path).
        clock: seconds, what the policy times steps with."""
        self.drafter = drafter
        self.policy = SpecPolicy(config.num_draft_tokens) if adaptive else None
        self.clock = clock
        self.emitted: int | None = None  # tokens the last step emitted as a verify step (None: it ran plain)
        self.on = False  # the policy let the last step speculate (it verified if a sequence had a draft)
        self.recent: deque[bool] = deque(maxlen=WINDOW)  # per pure-decode step: whether it verified
        self.k = config.num_draft_tokens  # the most tokens a sequence drafts per step
        self.pausing = pausing
        self.pauses: dict[int, tuple[int, int]] = {}  # by seq_id: (drafts again from this many tokens, pause length)
        self.max_batch_size = config.speculative_max_batch_size
        self.num_steps = 0  # verify steps run
        self.num_verified = 0  # (sequence, verify step) pairs that had a draft
        self.num_drafted = 0  # tokens proposed
        self.num_accepted = 0  # of those, tokens the target agreed with

    def applies(self, batch: Batch) -> bool:
        """Pure decode (one token per sequence, none in prefill), no larger than the auto-off batch size, and a
        sequence not pausing (`_pace`): else the step runs as plain decoding (overlapped on the GPU)."""
        return batch.is_decode and len(batch.seqs) <= self.max_batch_size and any(map(self._drafting, batch.seqs))

    def speculates(self, batch: Batch) -> bool:
        """Whether this pure-decode step drafts and verifies: the policy says speculating pays at this batch size
        (or measures it) and `applies`."""
        self.emitted = None
        self.on = len(batch.seqs) <= self.max_batch_size and (self.policy is None
                                                               or self.policy.speculate(len(batch.seqs)))
        return self.on and self.applies(batch)

    def timed(self, batch_size: int, started: float, steady: bool) -> None:
        """The pure-decode step of batch_size sequences that `speculates` was asked about started at `started`
        (clock) and ends now. The policy compares whole modes: steps it let speculate (verify steps, and steps
        that drafted nothing, whose drafting and lost overlap are speculation's costs too) against steps it kept
        plain. Overlapped, a plain step's wall time is its launch plus the wait for the step before: one step's time
        when a step was in flight (steady), only a launch when none was (after a verify step: not measured)."""
        self.recent.append(self.emitted is not None)
        if self.policy is not None and batch_size <= self.max_batch_size and (self.on or steady):
            tokens = self.emitted if self.emitted is not None else batch_size
            self.policy.record(batch_size, self.on, tokens, self.clock() - started, self.emitted is not None)

    def _drafting(self, seq: Sequence) -> bool:
        pause = self.pauses.get(seq.seq_id)
        return pause is None or seq.num_tokens >= pause[0]

    def step(self, engine, batch: Batch) -> list:
        """Runs `batch` (pure decode, every newest token on the host, nothing in flight) with drafts; the engine's
        RequestOutputs."""
        drafts = self._drafts(engine, batch)
        if not any(drafts):  # a plain step, overlapped where the engine overlaps (its outputs come with the next)
            if not engine.overlap:
                return engine._step_now(batch)
            engine.in_flight = engine._launch(batch)
            engine.scheduler.commit_full_blocks(batch.seqs)
            return []
        seqs = batch.seqs
        first = [s.num_tokens for s in seqs]  # position of the first token this step emits, per sequence
        for seq, d in zip(seqs, drafts):
            seq.token_ids.extend(d)
        try:
            counts = [len(d) + 1 for d in drafts]
            logits = engine.runner.run(Batch(seqs, counts), [list(range(n)) for n in counts])
        finally:
            for seq, n in zip(seqs, first):
                del seq.token_ids[n:]
        reqs = [engine.requests[s.request_id] for s in seqs]
        results = verify(engine.sampler, logits, drafts, [s.params for s in seqs], [q.seed for q in reqs], first)
        now, num_emitted = time.monotonic(), 0
        for seq, request, d, n, (tokens, logprobs) in zip(seqs, reqs, drafts, first, results):
            self.num_verified += bool(d)
            self.num_drafted += len(d)
            self.num_accepted += len(tokens) - 1
            self._pace(seq, len(d), len(tokens) - 1)
            for token, logprob in zip(tokens, logprobs):
                engine._append(seq, request, token, logprob, now)
                num_emitted += 1
                if seq.is_finished:  # its blocks are freed
                    break
            if not seq.is_finished:
                _roll_back(engine, seq, n + len(tokens) - 1)
        self.drafter.after_verify(seqs)
        self.num_steps += 1
        self.emitted = num_emitted
        engine.metrics.on_step(num_emitted)
        return [engine._output(s) for s in seqs if s.is_finished or engine.requests[s.request_id].stream]

    def _drafts(self, engine, batch: Batch) -> list[list[int]]:
        """Per sequence, the drafted tokens: at most k, fewer near max_tokens (the step emits one more than it
        accepts) and within the step's token budget; none when the pool has no blocks for them."""
        bm, budget = engine.block_manager, engine.config.max_num_tokens - len(batch.seqs)
        limits = []
        for seq in batch.seqs:
            left = engine.requests[seq.request_id].max_tokens - seq.num_completion_tokens - 1
            limits.append(max(0, min(self.k if self._drafting(seq) else 0, left, budget)))
            budget -= limits[-1]
        drafts = self.drafter.propose(batch.seqs, limits)
        for i, (seq, d) in enumerate(zip(batch.seqs, drafts)):
            if d and not bm.has_room(seq, len(d) + 1):
                if bm.can_append(seq, len(d) + 1):
                    bm.append(seq, len(d) + 1)
                else:
                    drafts[i] = []
        return drafts

    def _pace(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A step that drafted and accepted nothing pauses the sequence's drafting for its next 1, 2, 4 .. MAX_PAUSE
        tokens (doubling while drafts keep missing; an accepted token ends it): a verify step costs more than a
        decode step, more so on the GPU, where plain decode steps overlap with the host and a verify step waits for
        it. k itself stays num_draft_tokens: at the batch sizes that speculate, a verify step costs about the same
        for any k up to 8, and shrinking k after a rejection lost accepted tokens when replayed on real text
        (dev/bench/spec_policy_sim.py)."""
        if not self.pausing or not drafted:
            return
        if accepted:
            self.pauses.pop(seq.seq_id, None)
        else:
            pause = min(MAX_PAUSE, 2 * self.pauses.get(seq.seq_id, (0, 0))[1] or 1)
            self.pauses[seq.seq_id] = (seq.num_tokens + 1 + pause, pause)  # its token count after this step: + 1

    def release(self, seq: Sequence) -> None:
        """The target sequence finished or was aborted: the drafter drops what it keeps for it."""
        self.pauses.pop(seq.seq_id, None)
        self.drafter.release(seq)

    def gauges(self) -> dict[str, tuple[float, str]]:
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        mean = self.num_accepted / self.num_verified if self.num_verified else 0.0
        return {"lowbit_spec_draft_tokens_total": (self.num_drafted, "Tokens proposed by the drafter."),
                "lowbit_spec_accepted_tokens_total": (self.num_accepted, "Drafted tokens the target accepted."),
                "lowbit_spec_acceptance_rate": (rate, "Accepted / drafted tokens."),
                "lowbit_spec_accepted_tokens_mean": (mean, "Accepted tokens per sequence and verify step with a "
                                                     "draft.")} \
            | {"lowbit_spec_enabled_fraction": (sum(self.recent) / len(self.recent) if self.recent else 0.0,
                                                f"Pure-decode steps that ran as verify steps, of the last {WINDOW}.")} \
            | (self.policy.gauges() if self.policy is not None else {}) | self.drafter.gauges()


def _roll_back(engine, seq: Sequence, num_computed: int) -> None:
    """After a verify step: the K/V of the first num_computed tokens (the newest before the step and the accepted
    drafts) are valid; the rejected drafts' slots are overwritten before any step reads them. Blocks past the
    sequence's tokens go back to the pool; only full blocks of accepted tokens become findable by prefix reuse."""
    seq.num_computed_tokens = num_computed
    engine.block_manager.truncate(seq, seq.num_tokens)
    engine.scheduler.commit_full_blocks([seq])


def make_decoder(config: EngineConfig, target_runner=None, draft_runner=None) -> SpecDecoder | None:
    """The decoder for config.speculative (None: off). draft: draft_runner is the draft model's runner, its pool
    sized with the target's (spec/draft_model.py `load_draft_runner`, then the target's runner)."""
    if config.speculative is None:
        return None
    if config.speculative == "ngram":
        from lowbit.serve.spec.ngram import NgramDrafter
        return SpecDecoder(NgramDrafter(config.ngram_size), config, adaptive=config.speculative_adaptive)
    from lowbit.serve.spec.draft_model import DraftModelDrafter
    if draft_runner is None:
        raise ValueError("speculative: draft needs the draft model's runner (spec.draft_model.load_draft_runner)")
    return SpecDecoder(DraftModelDrafter(draft_runner, config), config, adaptive=config.speculative_adaptive)
