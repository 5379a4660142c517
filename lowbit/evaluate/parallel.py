"""Loglikelihood jobs (one context and its continuations) shared out over forked CPU worker processes."""
import multiprocessing

import torch

PACKED_CHUNK = 64  # with exact=False and workers > 1, jobs handed to a worker at a time (sorted and batched there)
LOCKSTEP_CHUNK = 2  # with batch > 1, a worker is handed this many times `batch` jobs at a time
_STATE = None  # (model, device, batch) the forked workers inherit copy-on-write; set only while a pool is alive


def default_workers() -> int:
    """One process: worker processes measured slower than one process on a shared 2-core machine (docs/evaluate.md)."""
    return 1


def score_all(model, jobs: list, device, workers: int, batch: int = 1, exact: bool = True):
    """Yields score_continuations(model, ctx, conts, device) for each (ctx, conts) in `jobs`, in job order.

    exact=False: documents in padded batches (evaluate/packed.py), equal to the above up to float rounding; with
    workers > 1 each process scores runs of PACKED_CHUNK jobs that way. Otherwise:

    With batch > 1, up to `batch` jobs run in lockstep with their linear layers' GEMMs shared (evaluate/lockstep.py).
    With workers > 1 (CPU only) the jobs run in forked processes with torch.get_num_threads() // workers threads
    each (with batch > 1: each process runs lockstep over runs of LOCKSTEP_CHUNK * batch jobs). Every job is computed
    exactly as in this process (same shapes, same kernels): at one thread per worker (OMP_NUM_THREADS=1) the results
    are bitwise those of workers=1, batch=1.
    """
    from lowbit.evaluate.harness import score_continuations, score_continuations_lockstep

    cpu = torch.device(device).type == "cpu"
    if not exact:
        yield from _packed(model, jobs, device, workers if cpu else 1)
        return
    if batch > 1 and workers <= 1 and len(jobs) > 1 and cpu:
        from lowbit.evaluate.lockstep import Lockstep

        yield from Lockstep(model, batch).map(lambda job: score_continuations_lockstep(model, *job, device), jobs)
        return
    if workers <= 1 or len(jobs) < 2 or not cpu:
        for ctx, conts in jobs:
            yield score_continuations(model, ctx, conts, device)
        return
    global _STATE
    _STATE = (model, device, batch)
    threads = max(1, torch.get_num_threads() // workers)
    if batch > 1:
        from lowbit.evaluate.lockstep import Lockstep

        Lockstep(model, batch)  # GEMM row classes probed here once; the forked workers inherit them
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads,
                                                       initargs=(threads,)) as pool:
            if batch <= 1:
                yield from pool.imap(_score, jobs, chunksize=2)
                return
            step = LOCKSTEP_CHUNK * batch
            for scored in pool.imap(_score_lockstep, [jobs[i:i + step] for i in range(0, len(jobs), step)]):
                yield from scored
    finally:
        _STATE = None


def _packed(model, jobs: list, device, workers: int):
    from lowbit.evaluate.packed import score_packed

    global _STATE
    if workers <= 1 or len(jobs) <= PACKED_CHUNK:
        yield from score_packed(model, jobs, device)
        return
    _STATE = (model, device, 1)
    threads = max(1, torch.get_num_threads() // workers)
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads,
                                                       initargs=(threads,)) as pool:
            for scored in pool.imap(_score_packed, [jobs[i:i + PACKED_CHUNK] for i in range(0, len(jobs), PACKED_CHUNK)]):
                yield from scored
    finally:
        _STATE = None


def _score_packed(jobs: list) -> list:
    from lowbit.evaluate.packed import score_packed

    model, device, _ = _STATE
    return list(score_packed(model, jobs, device))


def _score_lockstep(jobs: list) -> list:
    from lowbit.evaluate.harness import score_continuations_lockstep
    from lowbit.evaluate.lockstep import Lockstep

    model, device, batch = _STATE
    return list(Lockstep(model, batch).map(lambda job: score_continuations_lockstep(model, *job, device), jobs))


def _score(job):
    from lowbit.evaluate.harness import score_continuations

    model, device, _ = _STATE
    ctx, conts = job
    return score_continuations(model, ctx, conts, device)
