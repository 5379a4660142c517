"""Serving metrics in the Prometheus text format (no client library needed)."""
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.per_bucket = [0] * (len(buckets) + 1)  # observations in (bucket i-1, bucket i]; the last: above all
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        self.per_bucket[bisect_left(self.buckets, value)] += 1

    @property
    def counts(self) -> list[int]:
        """Prometheus' cumulative bucket counts: observations <= each bound."""
        return list(accumulate(self.per_bucket[:-1]))

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return lines


class EngineMetrics:
    window_s = 10.0

    def __init__(self):
        self.ttft = Histogram()
        self.itl = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated in one step)

    def on_step(self, num_generated: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.generation_tokens += num_generated
        self._recent.append((now, num_generated))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0

    def on_finish(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """gauges: name (labels included) -> (value, help) read from the engine at scrape time."""
        lines = self.ttft.render("lowbit_time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.render("lowbit_inter_token_latency_seconds", "Time between two tokens of a request.")
        counters = {"lowbit_prompt_tokens_total": (self.prompt_tokens, "Prompt tokens received."),
                    "lowbit_generation_tokens_total": (self.generation_tokens, "Tokens generated.")}
        for name, (value, help_text) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        lines += ["# HELP lowbit_requests_finished_total Finished requests by reason.",
                  "# TYPE lowbit_requests_finished_total counter"]
        lines += [f'lowbit_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.requests_finished.items())]
        gauges = gauges | {"lowbit_generation_tokens_per_second": (self.tokens_per_second(),
                                                                   f"Generated tokens/s over the last {self.window_s:.0f} s.")}
        described = set()  # a name with labels (name{key="value"}) is described once for all its label sets
        for name, (value, help_text) in gauges.items():
            base = name.split("{")[0]
            if base not in described:
                described.add(base)
                lines += [f"# HELP {base} {help_text}", f"# TYPE {base} gauge"]
            lines.append(f"{name} {value:g}")
        return "\n".join(lines) + "\n"
