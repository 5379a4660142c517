"""The engine on a background thread, for asyncio callers (the HTTP server). No HTTP imports here.

Every engine call (add, abort, step) holds one lock; the thread steps while there is work and sleeps otherwise.
Outputs reach each request's asyncio.Queue through its event loop. A request whose consumer goes away (client
disconnect, cancelled task) is aborted in the stream's `finally`, which frees its KV blocks.
"""
import asyncio
import threading
from itertools import count

from lowbit.serve.engine import Engine
from lowbit.serve.outputs import RequestOutput
from lowbit.serve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()
        self._work = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = count()
        self.error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="lowbit-engine", daemon=True)
        self._thread.start()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> asyncio.Queue:
        """Queues a request (ValueError for a bad one); its outputs arrive on the returned queue."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            self.engine.add_request(request_id, prompt, params)
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._work.set()
        return queue

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

    async def stream(self, request_id: str, queue: asyncio.Queue):
        """Yields the request's RequestOutputs until the finished one; aborts it if the consumer stops early."""
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        target = self._queues.get(request_id)
        if target is None:
            return
        loop, queue = target
        if isinstance(out, BaseException) or out.finished:
            del self._queues[request_id]
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _loop(self) -> None:
        while not self._stopped:
            self._work.wait()
            with self.lock:
                if not self.engine.has_unfinished():
                    self._work.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # fail every waiting request loudly, then stop stepping
                    self.error = e
                    for request_id in list(self._queues):
                        self._deliver(e, request_id)
                    raise
                for out in outputs:
                    self._deliver(out, out.request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=10)

    def snapshot(self) -> tuple[str, int]:
        """(Prometheus text, KV blocks in use), read under the lock."""
        with self.lock:
            return self.engine.metrics.render(self.engine.gauges()), self.engine.block_manager.num_used_blocks
