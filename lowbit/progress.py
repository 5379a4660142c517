"""Progress on stderr for long steps: a tqdm bar on a terminal, short timestamped lines elsewhere (logs, CI).

Imports nothing heavy (tqdm only when a bar is drawn), so CLI modules may import it at the top.
"""
import sys
import time
from contextlib import contextmanager


def note(message: str) -> None:
    print(f"[lowbit] {message}", file=sys.stderr, flush=True)


@contextmanager
def stage(what: str):
    """`[lowbit] what ...` before, `[lowbit] what: 1.2 s` after (nothing after a failure: its error says enough)."""
    note(f"{what} ...")
    t0 = time.perf_counter()
    yield
    note(f"{what}: {time.perf_counter() - t0:.1f} s")


class Progress:
    """`total` steps of `unit`. A tqdm bar on a terminal; otherwise one line at the first step, then at most one
    every `every` seconds, and one at the end, each `[lowbit] desc: done/total unit (pct %, elapsed s)`."""

    def __init__(self, total: int, desc: str, unit: str, every: float = 5.0):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.done = 0
        self.t0 = time.perf_counter()
        self.last = None  # perf_counter of the last line printed
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)

    def describe(self, desc: str) -> None:
        """A new label (e.g. the batch now running); a line-mode label change prints the next step at once."""
        if desc != self.desc:
            self.desc, self.last = desc, None
            if self.bar is not None:
                self.bar.set_description(desc)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.last is None or now - self.last >= self.every or self.done >= self.total:
            self.last = now
            pct = 100 * self.done / self.total if self.total else 100
            note(f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct:.0f} %, {now - self.t0:.1f} s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
