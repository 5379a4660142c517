"""Loglikelihood jobs (one context and its continuations) shared out over forked CPU worker processes."""
import multiprocessing
import os

import torch

_STATE = None  # (model, device) the forked workers inherit copy-on-write; set only while a pool is alive


def default_workers() -> int:
    """One worker per core this process may run on."""
    return len(os.sched_getaffinity(0))


def score_all(model, jobs: list, device, workers: int):
    """Yields score_continuations(model, ctx, conts, device) for each (ctx, conts) in `jobs`, in job order.

    With workers > 1 (CPU only) the jobs run in forked processes with torch.get_num_threads() // workers threads
    each. Every job is computed exactly as in this process (same shapes, same kernels): at one thread per worker
    (OMP_NUM_THREADS=1) the results are bitwise those of workers=1.
    """
    from lowbit.evaluate.harness import score_continuations

    if workers <= 1 or len(jobs) < 2 or torch.device(device).type != "cpu":
        for ctx, conts in jobs:
            yield score_continuations(model, ctx, conts, device)
        return
    global _STATE
    _STATE = (model, device)
    threads = max(1, torch.get_num_threads() // workers)
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads,
                                                       initargs=(threads,)) as pool:
            yield from pool.imap(_score, jobs, chunksize=2)
    finally:
        _STATE = None


def _score(job):
    from lowbit.evaluate.harness import score_continuations

    model, device = _STATE
    ctx, conts = job
    return score_continuations(model, ctx, conts, device)
