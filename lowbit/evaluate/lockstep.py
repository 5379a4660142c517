"""Exact cross-document batching: several documents' forward passes run in lockstep and share each linear's GEMM.

Each document's computation (transformers' own forward, unchanged) runs in its own thread, but only one thread runs
at a time: a document that reaches a linear layer parks its input and hands control back. When every running document
is parked, the parked inputs of each layer are concatenated into one GEMM, the results handed back row for row, and
the documents run on. Everything except the linears therefore runs with exactly the shapes of a one-document pass.

The GEMMs stay exact because a BLAS computes a row of x @ W^T the same way whatever the other rows are, within one
"row class" of row counts (each kernel the BLAS picks by row count: MKL has a 1-row, a small-matrix and a blocked
one). The classes are measured on this machine for each weight shape (`row_classes`); inputs are batched only with
inputs of their own class, into GEMMs that stay inside it, and a linear whose classes cannot be verified is never
batched. So every score is bitwise that of the one-document pass.
"""
import contextlib
import functools
import threading
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_BATCH = 16  # documents in flight: enough rows per GEMM for the blocked kernel's speed
PROBE_ROWS = 20  # row counts 1..PROBE_ROWS are each probed for their class; classes are assumed to start there
MAX_ROWS = 4096  # rows of one batched GEMM; bounds the memory of a batched lm_head ([rows, vocab] float32)

_local = threading.local()  # .task: the _Task running in this thread, if any


class _Aborted(BaseException):
    """Raised inside a parked document when the run stops early (another document failed, or the caller stopped)."""


def _class_of(rows: int, starts: list[int]) -> int:
    """Index of the row class (starts: their sorted first row counts) that a `rows`-row GEMM falls in."""
    return max(i for i, lo in enumerate(starts) if lo <= rows)


def _chunks(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of inputs (of `sizes` rows) grouped into GEMMs of at most `limit` rows each (inputs are never split)."""
    chunks, rows = [[]], 0
    for i, n in enumerate(sizes):
        if chunks[-1] and rows + n > limit:
            chunks.append([])
            rows = 0
        chunks[-1].append(i)
        rows += n
    return chunks


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def row_classes(out_features: int, in_features: int, bias: bool, threads: int) -> tuple[int, ...] | None:
    """First row counts of this machine's GEMM row classes for float32 x [M, in] @ W^T [in, out] (+ bias [out]) at
    `threads` intra-op threads (the caller's: the probe runs at the current setting); None: unverified.

    Within one class a GEMM gives each row bitwise the same result whatever the other rows are (MKL: 1, 2..15 and
    16 or more rows at SmolLM2's shapes; 1, 2 and 3 or more at tiny ones). Probed on random data: a class starts at
    each M <= PROBE_ROWS whose first M-1 rows differ from those of M-1 rows; then every class is checked on shifted
    rows, the last one far beyond PROBE_ROWS.
    """
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(4 * PROBE_ROWS, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    if torch.get_num_threads() != threads:
        raise ValueError(f"row_classes probes at the current {torch.get_num_threads()} threads, not {threads}")
    ys = [F.linear(x[:m], w, b) for m in range(1, PROBE_ROWS + 1)]  # ys[m - 1]: m rows
    starts = [1] + [m for m in range(2, PROBE_ROWS + 1) if not torch.equal(ys[m - 1][:m - 1], ys[m - 2])]
    ends = [lo - 1 for lo in starts[1:]] + [PROBE_ROWS]
    for lo, hi in zip(starts, ends):  # rows keep their result when the rows around them change within the class
        if hi > lo and not torch.equal(F.linear(x[hi - lo:hi], w, b), ys[hi - 1][hi - lo:hi]):
            return None
    last = F.linear(x, w, b)
    for shift, m in ((1, starts[-1]), (3, PROBE_ROWS + 7), (5, 3 * PROBE_ROWS)):
        if not torch.equal(F.linear(x[shift:shift + m], w, b), last[shift:shift + m]):
            return None
    return tuple(starts)


class _Task(threading.Thread):
    """One document's computation; runs only between the scheduler's step() and its next park() or its end."""

    def __init__(self, lockstep, fn, arg):
        super().__init__(daemon=True)  # never keeps the process alive, should a task be left parked
        self.lockstep, self.fn, self.arg = lockstep, fn, arg
        self.go = threading.Semaphore(0)
        self.request = None  # (module, input, real-row mask or None) while parked
        self.reply = None
        self.real = None  # bool mask over the leading dims of the inputs now run: False rows are padding
        self.result, self.error, self.done, self.aborted = None, None, False, False

    def run(self):
        self.go.acquire()
        if self.aborted:
            self.done = True
            self.lockstep.back.release()
            return
        _local.task = self
        torch.set_num_threads(self.lockstep.threads)  # intra-op threads are per thread: those of the caller
        try:
            self.result = self.fn(self.arg)
        except BaseException as e:  # re-raised by the scheduler in the caller's thread
            self.error = e
        self.done = True
        self.lockstep.back.release()

    def park(self, module, x, real):
        self.request = (module, x, real)
        self.lockstep.back.release()
        self.go.acquire()
        reply, self.reply, self.request = self.reply, None, None
        if self.aborted:
            raise _Aborted()
        return reply

    def abort(self) -> None:
        """Unwinds a started or parked task (from the scheduler's thread) and waits until its thread is done."""
        if not self.done:
            self.aborted = True
            self.go.release()
            self.lockstep.back.acquire()


@contextlib.contextmanager
def real_rows(mask: torch.Tensor):
    """Within a lockstep document: linear inputs whose leading dims have mask's shape compute only the True rows;
    the others (padding whose outputs nothing reads but masked attention) come out as zeros."""
    task = getattr(_local, "task", None)
    if task is None:
        yield
        return
    task.real = mask
    try:
        yield
    finally:
        task.real = None


class Lockstep:
    """Runs fn(item) for many items with their linear layers batched; results as if each ran alone."""

    def __init__(self, model: nn.Module, docs: int = 16):
        from lowbit.checkpoint.reference import ReferenceQuantLinear

        self.docs = docs
        self.back = threading.Semaphore(0)  # a task hands control back to the scheduler
        self.classes = {}  # linear -> its row classes' first row counts; linears whose GEMM rows could move are left out
        self.threads = torch.get_num_threads()  # intra-op threads the classes were probed at; every task runs at them
        for m in model.modules():
            if isinstance(m, (nn.Linear, ReferenceQuantLinear)):
                starts = row_classes(m.out_features, m.in_features, m.bias is not None, torch.get_num_threads())
                if starts is not None:
                    self.classes[m] = starts
        self.parked = 0  # linear inputs parked by documents (each would have been one GEMM)
        self.gemms = 0  # GEMMs run for them

    def map(self, fn, items: list):
        """Yields fn(item) for each item, in order; at most `docs` items in flight."""
        if torch.get_num_threads() != self.threads:
            raise ValueError(f"torch threads changed from {self.threads} to {torch.get_num_threads()} since the GEMM "
                             f"row classes were probed: build the Lockstep again")
        originals = {m: m.forward for m in self.classes}
        for m in self.classes:
            m.forward = self._parking_forward(m, originals[m])
        alive = {}  # item index -> its task, while started and not finished
        try:
            yield from self._schedule(fn, items, originals, alive)
        finally:
            for task in alive.values():
                task.abort()
            for m in self.classes:
                del m.forward  # the class's forward again

    def _bounds(self, module, cls: int) -> tuple[int, int]:
        """(fewest, most) rows of a GEMM in row class `cls` of this linear."""
        starts = self.classes[module]
        return starts[cls], starts[cls + 1] - 1 if cls + 1 < len(starts) else MAX_ROWS

    def _parking_forward(self, module, original):
        def forward(x):
            task = getattr(_local, "task", None)
            if task is None or task.lockstep is not self or not x.is_contiguous():
                return original(x)
            rows = x.numel() // x.shape[-1]
            real = task.real if task.real is not None and task.real.shape == x.shape[:-1] else None
            if real is None and self._bounds(module, _class_of(rows, self.classes[module]))[1] < 2 * rows:
                return original(x)  # no other input of this size fits in its class's GEMM
            return task.park(module, x, real)
        return forward

    def _step(self, task: _Task) -> None:
        task.go.release()
        self.back.acquire()
        if task.error is not None:
            raise task.error

    def _schedule(self, fn, items, originals, alive: dict):
        results, next_out, next_in, ready = {}, 0, 0, []
        while next_out < len(items):
            while next_in < len(items) and len(alive) < self.docs:
                task = _Task(self, fn, items[next_in])
                task.start()
                alive[next_in] = task
                ready.append(next_in)
                next_in += 1
            for i in ready:
                self._step(alive[i])
                if alive[i].done:
                    results[i] = alive.pop(i).result
            ready = [i for i in alive if alive[i].request is not None]
            self._run_parked([alive[i] for i in ready], originals)
            while next_out in results:
                yield results.pop(next_out)
                next_out += 1

    def _run_parked(self, tasks: list[_Task], originals: dict) -> None:
        groups = defaultdict(list)  # (module, row class of the input as given) -> parked tasks
        for t in tasks:
            module, x, _ = t.request
            groups[(module, _class_of(x.numel() // x.shape[-1], self.classes[module]))].append(t)
        for (module, cls), group in groups.items():
            lo, hi = self._bounds(module, cls)
            flat = [x.reshape(-1, x.shape[-1]) if real is None else x[real] for _, x, real in (t.request for t in group)]
            self.parked += len(group)
            for chunk in _chunks([f.shape[0] for f in flat], hi):
                self.gemms += 1
                _, x0, real0 = group[chunk[0]].request
                if len(chunk) == 1 and real0 is None:
                    group[chunk[0]].reply = originals[module](x0)  # the very GEMM of the one-document pass
                    continue
                rows = [flat[i] for i in chunk]
                fill = lo - sum(r.shape[0] for r in rows)  # zero rows keep a small GEMM inside its class
                y = originals[module](torch.cat(rows + ([rows[0].new_zeros(fill, rows[0].shape[1])] if fill > 0 else [])))
                sizes = [flat[i].shape[0] for i in chunk]
                for i, part in zip(chunk, y[:sum(sizes)].split(sizes)):
                    _, x, real = group[i].request
                    if real is None:
                        group[i].reply = part.reshape(*x.shape[:-1], part.shape[-1])
                    else:
                        out = part.new_zeros(*x.shape[:-1], part.shape[-1])
                        out[real] = part
                        group[i].reply = out
