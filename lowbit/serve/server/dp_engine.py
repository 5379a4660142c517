"""`--dp-size N`: N engine replicas in their own processes behind one server, with AsyncEngine's interface.

Each replica (dp_replica.py) gets its own devices (on CUDA: CUDA_VISIBLE_DEVICES narrowed to its tensor-parallel
size of GPUs; on the CPU: an equal share of the threads). The router (dp_router.py) picks a replica per request;
a reader thread per replica hands its outputs to the requests' asyncio queues. A replica that dies fails its
requests in flight (EngineDeadError: a 500 in OpenAI's shape), and the engine refuses new ones from then on
(`error` is set: /health answers 503); `on_failure(line)` tells the server.
"""
import asyncio
import multiprocessing
import os
import threading
from contextlib import contextmanager
from dataclasses import asdict
from itertools import count
from types import SimpleNamespace

from lowbit import models
from lowbit.serve.engine.engine import Engine
from lowbit.serve.server import dp_metrics, dp_replica
from lowbit.serve.server.async_engine import EngineDeadError, _resolve, drain
from lowbit.serve.server.dp_router import Router

_ENV_LOCK = threading.Lock()  # os.environ is narrowed while one replica is spawned


class ReplicaFace:
    """What the HTTP layer reads from `AsyncEngine.engine` (tokenizer, context, vocabulary, prompt checks, grammar
    compiler), for engines that live in other processes."""
    check_prompt = Engine.check_prompt
    grammars = Engine.grammars

    def __init__(self, path, infos: list[dict]):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_model_len = min(info["max_model_len"] for info in infos)
        self.runner = SimpleNamespace(model=SimpleNamespace(config={"vocab_size": infos[0]["vocab_size"]}))
        self.eos_token_ids = set(infos[0]["eos_token_ids"])
        self._grammars = None


class DataParallelEngine:
    def __init__(self, model, config, on_failure=None):
        """config: the EngineConfig every replica gets (data_parallel_size of them). on_failure(line): called on a
        reader thread once, when the first replica dies."""
        n = config.data_parallel_size
        self.on_failure = on_failure
        self.error: BaseException | None = None
        self.router = Router(n, config.block_size)
        self._ids = count()
        self._lock = threading.Lock()
        self._requests: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._acks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._scrapes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, int]] = {}
        self._closing = False
        path = models.resolve(str(model))
        replica_config = asdict(config) | {"data_parallel_size": 1}
        ctx = multiprocessing.get_context("spawn")
        self._procs, self._conns, self._send_locks = [], [], []
        for i, (env, threads) in enumerate(_placements(config, n)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=dp_replica.main, args=(i, str(path), replica_config, child, threads),
                               name=f"lowbit-replica-{i}")
            with _environ(env):
                proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._send_locks.append(threading.Lock())
        self.infos = [self._wait_ready(i) for i in range(n)]
        self.engine = ReplicaFace(path, self.infos)
        self._readers = [threading.Thread(target=self._read, args=(i,), name=f"lowbit-replica-{i}-reader",
                                          daemon=True) for i in range(n)]
        for t in self._readers:
            t.start()

    def _wait_ready(self, i: int) -> dict:
        try:
            message = self._conns[i].recv()
        except EOFError:
            self._procs[i].join(timeout=10)
            message = ("failed", f"exited with code {self._procs[i].exitcode}")
        if message[0] != "ready":
            self.shutdown()
            raise ValueError(f"data-parallel replica {i}: {message[1]}")
        return message[1]

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- called from the event loop (AsyncEngine's interface)
    async def add(self, request_id: str, prompt, params, stream: bool = True, prompt_text: str | None = None):
        self._check_alive()
        replica = self.router.pick(prompt)
        if replica is None:
            raise EngineDeadError("every data-parallel replica has stopped")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        with self._lock:
            self._requests[request_id] = (loop, outputs, replica)
            self._acks[request_id] = (loop, added)
        try:
            self._send(replica, ("add", request_id, prompt, params, stream, prompt_text))
            await added
        except BaseException:  # refused, the replica died, or the caller went away before the replica got it
            self.abort(request_id)
            raise
        return outputs

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.pop(request_id, None)
            self._acks.pop(request_id, None)
        if entry is not None:
            self.router.done(entry[2])
            if self.router.alive[entry[2]]:
                self._send(entry[2], ("abort", request_id))

    def stream(self, request_id: str, outputs: asyncio.Queue):
        """Yields the request's RequestOutputs until the finished one; aborts it if the consumer stops early."""
        return drain(outputs, lambda: self.abort(request_id))

    async def snapshot(self) -> tuple[str, int]:
        """(the replicas' Prometheus text merged, KV blocks in use over all replicas)."""
        loop = asyncio.get_running_loop()
        futures = []
        for i in range(len(self._procs)):
            future = loop.create_future()
            futures.append(future)
            if not self.router.alive[i]:
                future.set_result(None)
                continue
            token = next(self._ids)
            with self._lock:
                self._scrapes[token] = (loop, future, i)
            self._send(i, ("metrics", token))
        results = await asyncio.gather(*futures)
        used = [r[1] if r else None for r in results]
        text = dp_metrics.merge([r[0] if r else None for r in results], list(self.router.load),
                                list(self.router.routed), used)
        return text, sum(u for u in used if u is not None)

    def shutdown(self) -> None:
        self._closing = True
        for i, proc in enumerate(self._procs):
            if proc.is_alive():
                try:
                    self._send(i, ("stop",))
                except OSError:  # its pipe is gone: it is ending anyway
                    pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    close = shutdown

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(str(self.error))

    def _send(self, replica: int, message) -> None:
        with self._send_locks[replica]:
            self._conns[replica].send(message)

    # ---- the reader threads, one per replica
    def _read(self, replica: int) -> None:
        conn = self._conns[replica]
        try:
            while True:
                self._handle(replica, conn.recv())
        except (EOFError, OSError):  # the replica's end of the pipe closed: it exited
            pass
        if self._closing:
            return
        self._procs[replica].join(timeout=10)
        self._fail(replica, f"data-parallel replica {replica} exited with code {self._procs[replica].exitcode}")

    def _handle(self, replica: int, message) -> None:
        kind = message[0]
        if kind == "outs":
            for out in message[1]:
                with self._lock:
                    entry = self._requests.get(out.request_id)
                    if entry is not None and out.finished:
                        del self._requests[out.request_id]
                if entry is None:
                    continue
                if out.finished:
                    self.router.done(replica)
                entry[0].call_soon_threadsafe(entry[1].put_nowait, out)
        elif kind == "added":
            _, request_id, error = message
            with self._lock:
                ack = self._acks.pop(request_id, None)
            if ack is not None:
                ack[0].call_soon_threadsafe(_resolve, ack[1], None, error)
        elif kind == "metrics":
            _, token, text, used = message
            with self._lock:
                loop, future, _ = self._scrapes.pop(token)
            loop.call_soon_threadsafe(_resolve, future, (text, used))

    def _fail(self, replica: int, line: str) -> None:
        """Fails the dead replica's requests, acks and scrapes; refuses new work from now on."""
        self.router.dead(replica)
        error = EngineDeadError(line)
        with self._lock:
            first = self.error is None
            if first:
                self.error = error
            requests = [(rid, e) for rid, e in self._requests.items() if e[2] == replica]
            for rid, _ in requests:
                del self._requests[rid]
            acks = [self._acks.pop(rid) for rid, _ in requests if rid in self._acks]
            scrapes = [(t, s) for t, s in self._scrapes.items() if s[2] == replica]
            for t, _ in scrapes:
                del self._scrapes[t]
        for _, (loop, outputs, _) in requests:
            self.router.done(replica)
            loop.call_soon_threadsafe(outputs.put_nowait, error)
        for loop, future in acks:
            loop.call_soon_threadsafe(_resolve, future, None, error)
        for _, (loop, future, _) in scrapes:
            loop.call_soon_threadsafe(_resolve, future, None)
        if first and self.on_failure is not None:
            self.on_failure(line)


def _placements(config, n: int) -> list[tuple[dict, int | None]]:
    """Per replica: (environment changes, torch threads). CUDA: consecutive groups of tensor_parallel_size GPUs
    of those visible; CPU: the threads shared out."""
    import torch

    tp = config.tensor_parallel_size
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return [({}, max(1, torch.get_num_threads() // n))] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < n * tp:
        raise ValueError(f"--dp-size {n} x --tp-size {tp} needs {n * tp} GPUs; {len(gpus)} are visible")
    return [({"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])}, None) for i in range(n)]


@contextmanager
def _environ(changes: dict):
    """os.environ with `changes` while a child is spawned (it copies the environment at start)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in changes}
        os.environ.update(changes)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
