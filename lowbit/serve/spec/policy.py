"""Whether speculating pays, per decode batch size: tokens per second of wall time of verify steps against plain
decode steps, measured online per batch-size bucket (1, 2, 3-4, 5-8, ...); while it does not pay, decoding runs
plain and re-probes speculation after a back-off that doubles each time a probe loses."""
from dataclasses import dataclass, field

MARGIN = 1.05  # verify steps must emit this many times the plain rate to keep speculating
ALPHA = 0.25  # weight of the newest step in the moving averages
WARM = 2  # steps of each kind a bucket measures before it decides (after one not measured)
PROBE = 1  # verify steps a probe measures, after one it does not (its own averages: the workload may have changed)
MIN_BACKOFF, MAX_BACKOFF = 32, 1024  # plain steps before the next probe; doubles while probes keep losing
STALL = 10.0  # a step this many times its kind's mean time is a stall (a compile, GC, swap): not measured


@dataclass
class Rate:
    """Moving averages of the tokens a kind of step emits and of its wall seconds (their ratio: tokens/s)."""
    skip: int = 0  # first samples not measured: a bucket's first step of a kind launches kernels the first time
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
    verify: Rate = field(default_factory=lambda: Rate(skip=1))
    on: bool = False  # speculating: the last decision found that verify steps pay
    probing: int = WARM  # measured verify steps to run before the next decision
    wait: int = 0  # plain steps left before the next probe (while off)
    backoff: int = MIN_BACKOFF

    @property
    def speculating(self) -> bool:
        return self.plain.n >= WARM and (self.probing > 0 or self.on)

    @property
    def gain(self) -> float:
        """Verify steps' tokens/s over plain steps' (0: not measured yet)."""
        return self.verify.per_second / self.plain.per_second if self.plain.n and self.verify.n else 0.0


def bucket_of(batch_size: int) -> int:
    """0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ...: batch sizes whose steps cost about the same."""
    return (batch_size - 1).bit_length()


def bucket_label(index: int) -> str:
    lo, hi = (1 << (index - 1)) + 1 if index else 1, 1 << index
    return str(hi) if lo == hi else f"{lo}-{hi}"


class SpecPolicy:
    """`speculate(b)` before a pure-decode step of b sequences, `record(b, verified, tokens, seconds)` after it."""

    def __init__(self):
        self.buckets: dict[int, Bucket] = {}

    def speculate(self, batch_size: int) -> bool:
        """Plain until the bucket has WARM plain steps measured, then WARM verify steps; then verify while it pays,
        else plain with a probe (PROBE verify steps) after `backoff` plain steps."""
        return self.buckets.setdefault(bucket_of(batch_size), Bucket()).speculating

    def record(self, batch_size: int, verified: bool, tokens: int, seconds: float) -> None:
        """A pure-decode step ran: as a verify step (verified) or plain; it emitted tokens in seconds of wall time
        (on the GPU a plain step's tokens arrive with the next step: step-to-step time, the same count)."""
        b = self.buckets.setdefault(bucket_of(batch_size), Bucket())
        if not verified:
            b.plain.add(tokens, seconds)
            if not b.on and not b.probing:
                b.wait -= 1
                if b.wait <= 0:  # probe: measure verify steps afresh, from the second (the first waits for the
                    b.probing, b.verify = PROBE, Rate(skip=1)  # plain step in flight; a draft model catches up)
            return
        b.verify.add(tokens, seconds)
        if not b.verify.n:  # the bucket's first verify step: not measured
            return
        b.probing = max(0, b.probing - 1)
        if b.probing or b.plain.n < WARM:
            return
        if b.verify.per_second > MARGIN * b.plain.per_second:
            b.on, b.backoff = True, MIN_BACKOFF
        else:
            b.on, b.wait, b.backoff = False, b.backoff, min(MAX_BACKOFF, 2 * b.backoff)

    def gauges(self) -> dict[str, tuple[float, str]]:
        out = {}
        for i, b in sorted(self.buckets.items()):
            label = f'{{batch="{bucket_label(i)}"}}'
            out[f"lowbit_spec_speculating{label}"] = (float(b.speculating), "1 while speculation pays in this "
                                                      "decode batch-size bucket (or is being measured), else 0.")
            out[f"lowbit_spec_gain{label}"] = (b.gain, "Measured tokens/s of verify steps over plain decode steps "
                                               "in this bucket (0: not measured yet).")
        return out
