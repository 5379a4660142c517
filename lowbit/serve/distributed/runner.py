"""Rank 0 of a tensor-parallel engine: starts the other ranks, runs its own shard, broadcasts each step's inputs,
and turns a rank's death into one error (never a hang)."""
import atexit
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from lowbit.checkpoint import Checkpoint
from lowbit.serve.distributed import worker
from lowbit.serve.distributed.group import TensorParallelGroup
from lowbit.serve.distributed.sharding import local_config
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.runner.model_runner import ModelRunner

WATCH_S = 0.2  # how often rank 0 looks at the other ranks
GRACE_S = 30.0  # a collective still blocked this long after a rank died ends the process (NCCL does not fail fast)
JOIN_S = 10.0  # how long close() waits for the ranks to stop before killing them


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot step any more."""


class TensorParallelRunner:
    """ModelRunner's interface over tensor_parallel_size processes; this process is rank 0 and samples."""

    def __init__(self, ckpt: Checkpoint, config: EngineConfig):
        world = config.tensor_parallel_size
        local_config(ckpt.config, world)  # heads or sizes the ranks cannot share: refused before anything starts
        if dist.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; close() it first")
        config = replace(config, overlap_steps=False)
        self.failure: str | None = None
        self.on_failure = None  # called with the failure line from the watchdog thread (the server exits there)
        self._busy_since: float | None = time.monotonic()  # rank 0 is in a collective (or starting) since
        self._tmp = Path(tempfile.mkdtemp(prefix="lowbit-tp-"))
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        source = ckpt if ckpt.convert is None else ckpt.path  # a converter is a closure: the rank reads the path
        self._procs = [ctx.Process(target=worker.main, daemon=True, name=f"lowbit-tp-rank{r}",
                                   args=(r, world, source, config, str(self._tmp / "rendezvous"), self._errors))
                       for r in range(1, world)]
        for p in self._procs:
            p.start()
        self._closed, self.group = False, None
        threading.Thread(target=self._watch, daemon=True, name="lowbit-tp-watchdog").start()
        atexit.register(self.close)
        try:
            self.group = TensorParallelGroup(0, world, worker.rank_device(config, 0), str(self._tmp / "rendezvous"))
            self.local = ModelRunner(ckpt, config, tp=self.group)
        except ValueError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise RankFailure(self._failure_line(e)) from e
        self._busy_since = None

    def __getattr__(self, name):  # device, model, num_blocks, kv_dtype, sliding_window, host_cache, ...
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def move_blocks(self, moves) -> None:
        if moves:
            self._collective(lambda: (self.group.broadcast(("moves", moves)), self.local.move_blocks(moves)))

    def run(self, batch, logit_rows, pending=None):
        """ModelRunner.run on every rank; the logits (all ranks' vocabulary slices) come back on rank 0."""
        if pending is not None:
            raise ValueError("overlapped steps are not supported with tensor parallelism")
        host = self.local.host_inputs(batch, logit_rows)
        return self._collective(lambda: (self.group.broadcast(("step", host)), self.local.run_host(host))[1])

    def _collective(self, fn):
        if self.failure is not None:
            raise RankFailure(self.failure)
        self._busy_since = time.monotonic()
        try:
            return fn()
        except RuntimeError as e:  # gloo / NCCL: a peer went away or timed out
            raise RankFailure(self._failure_line(e)) from e
        finally:
            self._busy_since = None

    def _failure_line(self, error: BaseException) -> str:
        """One line: the first rank that reported or died, else the collective's own error."""
        deadline = time.monotonic() + 2.0  # a dying rank's report may still be on its way
        while self.failure is None and time.monotonic() < deadline:
            self._check_ranks()
            time.sleep(0.05)
        return self.failure or f"tensor parallelism failed on rank 0: {str(error).splitlines()[0]}"

    def _check_ranks(self) -> None:
        if self.failure is not None:
            return
        while not self._errors.empty():
            rank, message = self._errors.get()
            self.failure = f"tensor parallel rank {rank} failed: {message.splitlines()[0]}"
            return
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs, 1) if p.exitcode is not None]
        if dead:
            self.failure = f"tensor parallel rank {dead[0][0]} exited with code {dead[0][1]}"

    def _watch(self) -> None:
        """Watchdog: notices a rank that died; if rank 0 stays blocked in a collective GRACE_S after that, the
        process ends with the failure line (exit 1)."""
        while not self._closed:
            self._check_ranks()
            if self.failure is not None:
                if self.on_failure is not None:
                    self.on_failure(self.failure)
                since = time.monotonic()
                while not self._closed and self._busy_since is not None:
                    if time.monotonic() - since > GRACE_S:
                        print(f"error: {self.failure}", file=sys.stderr, flush=True)
                        os._exit(1)
                    time.sleep(WATCH_S)
                return
            time.sleep(WATCH_S)

    def close(self) -> None:
        """Stops every rank and leaves the process group; the engine cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        alive = [p for p in self._procs if p.is_alive()]
        if self.group is not None and self.failure is None and alive and len(alive) == len(self._procs):
            try:
                self.group.broadcast(worker.STOP)
            except RuntimeError as e:  # a rank went away meanwhile: recorded; the rest are killed below
                self.failure = f"tensor parallelism failed while stopping: {str(e).splitlines()[0]}"
        for p in self._procs:
            p.join(timeout=JOIN_S if p.is_alive() else 0)
            if p.is_alive():
                p.kill()
                p.join()
        if self.group is not None:
            self.group.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
