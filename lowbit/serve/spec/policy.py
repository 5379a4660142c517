"""Whether speculating pays, per decode batch size: tokens per second of wall time of the decode steps run
speculating (verify steps, and steps that drafted nothing) against those run plain, measured online per batch-size
bucket (1, 2, 3-4, 5-8, ...); while it does not pay, decoding runs plain and re-probes speculation after a back-off
that doubles each time a probe loses, or after the longest back-off where the verify step alone costs more than the
k + 1 plain steps whose tokens it could emit at best (then no workload can make it pay). A bucket seen for the first
time above one where speculating lost starts off (a larger batch gains less from it: its verify steps cost more
against its plain ones) and waits that bucket's back-off before its own probe. While speculating wins, plain steps
are re-measured after stretches of speculating steps that double, so a stale plain rate cannot keep it on."""
from dataclasses import dataclass, field

MARGIN = 1.05  # speculating steps must emit this many times the plain rate to keep speculating
ALPHA = 0.25  # weight of the newest step in the moving averages
WARM = 2  # steps of each mode a bucket measures before it decides (after one not measured)
PROBE = 2  # speculating steps a probe measures, after one it does not (afresh: the workload may have changed)
MIN_BACKOFF, MAX_BACKOFF = 32, 1024  # plain steps before the next probe; doubles while probes keep losing
STALL = 10.0  # a step this many times its mode's mean time is a stall (a compile, GC, swap): not measured


@dataclass
class Rate:
    """Moving averages of the tokens a mode's steps emit and of their wall seconds (their ratio: tokens/s)."""
    skip: int = 0  # first samples not measured: a bucket's first step of a mode launches kernels the first time
    n: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if self.skip:
            self.skip -= 1
            return
        if self.n and seconds > STALL * self.seconds:
            return
        weight = 1.0 if self.n == 0 else ALPHA
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.n += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Bucket:
    plain: Rate = field(default_factory=lambda: Rate(skip=1))
    spec: Rate = field(default_factory=lambda: Rate(skip=1))
    verify: Rate = field(default_factory=lambda: Rate(skip=1))  # the speculating steps that verified drafts
    on: bool = False  # speculating: the last decision found that it pays
    probing: int = WARM  # measured speculating steps to run before the next decision
    wait: int = 0  # plain steps left before the next probe (while off)
    backoff: int = field(default_factory=lambda: MIN_BACKOFF)
    recheck: int = field(default_factory=lambda: MIN_BACKOFF)  # speculating steps left before plain is re-measured
    recheck_every: int = field(default_factory=lambda: MIN_BACKOFF)  # doubles while speculating keeps winning
    checking: int = 0  # plain steps left in a re-measure (while on)

    @property
    def speculating(self) -> bool:
        return self.plain.n >= WARM and not self.checking and (self.probing > 0 or self.on)

    @property
    def gain(self) -> float:
        """Speculating steps' tokens/s over plain steps' (0: not measured yet)."""
        return self.spec.per_second / self.plain.per_second if self.plain.n and self.spec.n else 0.0

    @property
    def lost(self) -> bool:
        """The last decision found that speculating does not pay here."""
        return not self.on and not self.probing

    def probe_wait(self, num_draft_tokens: int) -> int:
        """Plain steps to run before the next probe: the back-off; the longest where a verify step costs more than
        the k + 1 plain steps whose tokens it emits when every draft is accepted."""
        if self.verify.n and (num_draft_tokens + 1) * self.plain.seconds < MARGIN * self.verify.seconds:
            return MAX_BACKOFF
        return self.backoff


def bucket_of(batch_size: int) -> int:
    """0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ...: batch sizes whose steps cost about the same."""
    return (batch_size - 1).bit_length()


def bucket_label(index: int) -> str:
    lo, hi = (1 << (index - 1)) + 1 if index else 1, 1 << index
    return str(hi) if lo == hi else f"{lo}-{hi}"


class SpecPolicy:
    """`speculate(b)` before a pure-decode step of b sequences, `record(b, speculated, tokens, seconds)` after it."""

    def __init__(self, num_draft_tokens: int):
        self.k = num_draft_tokens  # the most tokens a sequence drafts per step
        self.buckets: dict[int, Bucket] = {}

    def speculate(self, batch_size: int) -> bool:
        """Plain until the bucket has WARM plain steps measured, then WARM speculating steps; then speculating while
        it pays, else plain with a probe (PROBE speculating steps) after `backoff` plain steps."""
        index = bucket_of(batch_size)
        if index not in self.buckets:
            self.buckets[index] = self._new_bucket(index)
        return self.buckets[index].speculating

    def _new_bucket(self, index: int) -> Bucket:
        """Off, waiting the nearest smaller bucket's back-off, when speculating lost there; else to be measured."""
        below = [b for i, b in sorted(self.buckets.items()) if i < index]
        if not below or not below[-1].lost:
            return Bucket()
        return Bucket(probing=0, wait=below[-1].backoff, backoff=below[-1].backoff)

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float, verified: bool = False) -> None:
        """A pure-decode step ran, speculating (as `speculate` said; verified: it had drafts to verify) or plain; it
        emitted tokens in seconds of wall time (on the GPU a plain step's tokens arrive with the next step:
        step-to-step time, the same count)."""
        index = bucket_of(batch_size)
        b = self.buckets.get(index) or self.buckets.setdefault(index, self._new_bucket(index))
        if not speculated:
            b.plain.add(tokens, seconds)
            if b.checking:
                b.checking -= 1
                if not b.checking:
                    self._decide(b)
            elif not b.on and not b.probing:
                b.wait -= 1
                if b.wait <= 0:  # probe: measure afresh, from the second step (the first waits for the plain
                    b.probing, b.spec = PROBE, Rate(skip=1)  # step in flight; a draft model catches up)
            return
        b.spec.add(tokens, seconds)
        if verified:
            b.verify.add(tokens, seconds)
        if not b.spec.n:  # not measured
            return
        b.probing = max(0, b.probing - 1)
        if b.probing or b.plain.n < WARM:
            return
        if b.on:
            b.recheck -= 1
            if b.recheck <= 0:  # the plain rate, measured afresh: the load or the step costs may have changed
                b.checking, b.plain = 1 + PROBE, Rate(skip=1)
                return
        self._decide(b)

    def _decide(self, b: Bucket) -> None:
        """Speculate on while it beats plain by MARGIN (re-measuring plain after doubling stretches), else off."""
        if b.spec.per_second > MARGIN * b.plain.per_second:
            if not b.on or not b.recheck:
                b.recheck_every = MIN_BACKOFF if not b.on else min(MAX_BACKOFF, 2 * b.recheck_every)
                b.recheck = b.recheck_every
            b.on, b.backoff = True, MIN_BACKOFF
        else:
            b.on, b.wait = False, b.probe_wait(self.k)
            b.backoff = min(MAX_BACKOFF, 2 * b.backoff)

    def gauges(self) -> dict[str, tuple[float, str]]:
        out = {}
        for i, b in sorted(self.buckets.items()):
            label = f'{{batch="{bucket_label(i)}"}}'
            out[f"lowbit_spec_speculating{label}"] = (float(b.speculating), "1 while speculating pays in this "
                                                      "decode batch-size bucket (or is being measured), else 0.")
            out[f"lowbit_spec_gain{label}"] = (b.gain, "Measured tokens/s of speculating over plain decode steps "
                                               "in this bucket (0: not measured yet).")
        return out
