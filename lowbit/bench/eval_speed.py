"""`lowbit bench eval-speed`: `lowbit eval`'s candidate pass, today's one-process scorer vs worker processes.

Both runs score the same checkpoint in this process on the same tasks and limit, one after the other, with a baseline
computed (or read from the cache) first and shared; it prints each run's wall time and its scores, and whether every
per-document score is identical.

    OMP_NUM_THREADS=1 lowbit bench eval-speed CKPT --limit 200           # default tasks, workers = cores
    OMP_NUM_THREADS=1 lowbit bench eval-speed CKPT --tasks arc_easy --limit 50 --workers 2 --json out.jsonl
"""
import argparse
import logging
import os
import platform
import time

import torch


def parse(argv):
    from lowbit.evaluate.cli import DEFAULT_TASKS

    p = argparse.ArgumentParser(prog="lowbit bench eval-speed", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="CHECKPOINT", help="store name or checkpoint directory (with a source model)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--workers", type=int, help="worker processes of the new path (default: one per core)")
    p.add_argument("--json", help="append the two runs as JSON lines to this file")
    return p.parse_args(argv)


def main(argv) -> int:
    from lowbit.bench_cli import json_lines
    from lowbit.checkpoint import read
    from lowbit.evaluate.cli import parse_tasks
    from lowbit.evaluate.parallel import default_workers
    from lowbit.evaluate.runner import Plan, Side, baseline_results, candidate_results
    from lowbit.models import resolve

    args = parse(argv)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    tasks = parse_tasks([args.tasks])
    path = resolve(args.model)
    source = (read(path).manifest or {}).get("source_model")
    workers = args.workers or default_workers()
    print(f"# eval-speed: {args.model}, tasks {','.join(tasks)}, limit {args.limit}, {platform.node()}, "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    base_text = None
    if source:  # computed once (or read from the cache) before either timed run
        base_text = baseline_results(Side(source, resolve(source)), Plan(tasks, args.limit, workers=workers))["text"]
    emit, _ = json_lines(args.json)
    runs = []
    for label, n in (("today", 1), ("new", workers)):
        side = Side(args.model, path)  # each run loads the checkpoint itself, as `lowbit eval` does
        t0 = time.perf_counter()
        side.model()
        result = candidate_results(side, Plan(tasks, args.limit, workers=n), base_text)
        seconds = time.perf_counter() - t0
        runs.append((seconds, result))
        emit({"run": label, "workers": n, "seconds": seconds,
              "scores": {t: r["metrics"] for t, r in result["tasks"].items()},
              "text_nll": result["text"]["nll"] if isinstance(result["text"], dict) else None})
    (t_old, old), (t_new, new) = runs
    same_tasks = old["tasks"] == new["tasks"]  # every metric and every per-document score, exactly
    same_text = _text(old) == _text(new)
    print(f"today {t_old:.1f} s, new {t_new:.1f} s: {t_old / t_new:.2f}x faster; per-document task scores "
          f"identical: {same_tasks}; held-out text results identical: {same_text}")
    return 0 if same_tasks and same_text else 1


def _text(result: dict):
    text = result["text"]  # compare_pass's dict (with a baseline), a TextPass of tensors (without) or None
    if text is None or isinstance(text, dict):
        return text
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(text).items()}
