"""`lowbit bench eval-speed`: `lowbit eval`'s scoring as it was (one document at a time, worker processes, lm-eval's
full setup) vs the fast gate (documents in lockstep sharing GEMMs, or with --packed in padded batches; lean
lm-eval setup), side by side in one run.

Both runs score the same checkpoint in this process on the same tasks and limit, one after the other, each loading
the checkpoint itself. Warm (default): the baseline is computed (or read from the cache) first and shared, as in
a CI job whose eval cache is kept; --cold: each run computes the baseline too, in a fresh private cache. It prints
each run's wall time and CPU time (this process and its worker processes: on a shared machine the fairer figure,
as other jobs' load moves the wall time), whether every per-document score and the held-out text results are
identical and every loglikelihood bitwise equal (with --packed: within LL_TOL of the old one; exit 1 if not).

    OMP_NUM_THREADS=1 lowbit bench eval-speed smollm2-135m-fp8 --limit 200           # default tasks, warm baseline
    OMP_NUM_THREADS=1 lowbit bench eval-speed smollm2-135m-int4_awq --limit 200 --cold --json out.jsonl
"""
import argparse
import contextlib
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

# padded batches vs one document at a time: loglikelihood gap relative to max(1, |log P|). The one-document path
# itself moves that much on SmolLM2 FP8 when only its batch shape changes (choices scored together or alone: 1.6 %)
LL_TOL = 0.05


def parse(argv):
    from lowbit.evaluate.cli import DEFAULT_TASKS
    from lowbit.evaluate.lockstep import DEFAULT_BATCH

    p = argparse.ArgumentParser(prog="lowbit bench eval-speed", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="CHECKPOINT", help="store name or checkpoint directory (with a source model)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--packed", action="store_true", help="new path: documents in padded batches (lowbit eval "
                                                         "--packed) instead of lockstep")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="documents in lockstep on the new path")
    p.add_argument("--workers", type=int, default=1, help="worker processes of the new path (default 1, as lowbit eval)")
    p.add_argument("--old-workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="worker processes of the old path (default: one per core, the old default)")
    p.add_argument("--cold", action="store_true", help="each run computes the baseline too (fresh cache)")
    p.add_argument("--json", help="append the two runs as JSON lines to this file")
    return p.parse_args(argv)


def main(argv) -> int:
    from lowbit.bench_cli import json_lines
    from lowbit.checkpoint import read
    from lowbit.evaluate.cli import parse_tasks
    from lowbit.evaluate.runner import Plan, Side, baseline_results
    from lowbit.models import resolve

    args = parse(argv)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    tasks = parse_tasks([args.tasks])
    path = resolve(args.model)
    source = (read(path).manifest or {}).get("source_model")
    if args.cold and not source:
        raise SystemExit(f"{args.model}: no source model in its manifest, nothing to compute cold")
    print(f"# eval-speed: {args.model}, tasks {','.join(tasks)}, limit {args.limit}, "
          f"{'cold' if args.cold else 'warm'} baseline, {platform.node()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    base = None
    if source and not args.cold:  # computed once (or read from the cache) before either timed run
        base = baseline_results(Side(source, resolve(source)), Plan(tasks, args.limit))
    emit, _ = json_lines(args.json)
    runs = {}
    plans = {"old": Plan(tasks, args.limit, workers=args.old_workers, batch=1, exact=True, lean=False),
             "new": Plan(tasks, args.limit, workers=args.workers, batch=args.batch, exact=not args.packed, lean=True)}
    for label, plan in plans.items():
        cpu0 = _cpu_seconds()
        seconds, result, scores = _timed_run(args.model, path, source, plan, base)
        cpu = _cpu_seconds() - cpu0
        runs[label] = (seconds, result, scores, cpu)
        emit({"run": label, "workers": plan.workers, "batch": plan.batch, "exact": plan.exact, "cold": args.cold,
              "seconds": seconds,
              "cpu_seconds": cpu, "scores": {t: r["metrics"] for t, r in result["cand"]["tasks"].items()},
              "load": os.getloadavg()[0]})
        print(f"{label}: {seconds:.1f} s wall, {cpu:.1f} s CPU (workers {plan.workers}, batch {plan.batch}, "
              f"exact {plan.exact}, lean {plan.lean}), load {os.getloadavg()[0]:.1f}", flush=True)
    (t_old, old, s_old, c_old), (t_new, new, s_new, c_new) = runs["old"], runs["new"]
    worst, tol = _loglikelihood_gap(s_old, s_new), LL_TOL if args.packed else 0.0
    checks = {"per-document task scores": old["cand"]["tasks"] == new["cand"]["tasks"],
              f"loglikelihoods ({len(s_old)}) within {tol} (worst {worst:.2g})": worst <= tol,
              "held-out text results": _text(old["cand"]) == _text(new["cand"])}
    if args.cold:
        checks["baseline task scores"] = old["base"]["tasks"] == new["base"]["tasks"]
        checks["baseline held-out text"] = _text(old["base"]) == _text(new["base"])
    print(f"old {t_old:.1f} s, new {t_new:.1f} s: {t_old / t_new:.2f}x faster in wall time, {c_old / c_new:.2f}x in "
          f"CPU time ({c_old:.1f} s vs {c_new:.1f} s); identical: "
          + "; ".join(f"{k}: {v}" for k, v in checks.items()))
    return 0 if all(checks.values()) else 1


def _timed_run(name, path, source, plan, base):
    """(seconds, {base, cand}, [every loglikelihood answer of the run, in order]) for one scoring path."""
    from lowbit.evaluate import cache, parallel
    from lowbit.evaluate.runner import Side, baseline_results, candidate_results
    from lowbit.models import resolve

    answers, score_all = [], parallel.score_all

    def recording(*a, **k):
        for scored in score_all(*a, **k):
            answers.append(scored)
            yield scored

    with tempfile.TemporaryDirectory() as tmp, _patched(cache, "cache_dir", lambda: Path(tmp)) if base is None \
            else contextlib.nullcontext(), _patched(parallel, "score_all", recording):
        t0 = time.perf_counter()
        if base is None and source:
            base = baseline_results(Side(source, resolve(source)), plan)
        side = Side(name, path)  # each run loads the checkpoint itself, as `lowbit eval` does
        result = {"base": base, "cand": candidate_results(side, plan, base["text"] if base else None)}
        return time.perf_counter() - t0, result, answers


def _loglikelihood_gap(old: list, new: list) -> float:
    """Largest |log P(old) - log P(new)| / max(1, |log P(old)|) over all continuations; inf if the answers' count,
    order or greedy flags differ."""
    pairs = [(a, b) for x, y in zip(old, new) for a, b in zip(x, y)]
    if [len(x) for x in old] != [len(y) for y in new] or any(a[1] != b[1] for a, b in pairs):
        return float("inf")
    return max((abs(a[0] - b[0]) / max(1.0, abs(a[0])) for a, b in pairs), default=0.0)


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) and of its finished child processes."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def _patched(obj, attr, value):
    saved = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, saved)


def _text(result: dict | None):
    text = (result or {}).get("text")  # compare_pass's dict, a TextPass of tensors, or None
    if text is None or isinstance(text, dict):
        return text
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(text).items()}
