"""The engine on a background thread, for asyncio callers (the HTTP server). No HTTP imports here.

The engine thread owns the Engine (and its tokenizer): callers never touch it, they send commands (add, abort,
snapshot) through a queue that the thread drains between steps, so a caller waits at most one step and the event
loop never blocks on a lock the stepping thread keeps re-taking. Outputs reach each request's asyncio.Queue through
its event loop. A request whose consumer goes away (client disconnect, cancelled task) is aborted in the stream's
`finally`, which frees its KV blocks at the next step boundary.
"""
import asyncio
import queue
import threading
from itertools import count

from lowbit.serve.engine.engine import Engine
from lowbit.serve.server.access_log import count_tokens
from lowbit.serve.engine.outputs import RequestOutput
from lowbit.serve.engine.sampling_params import SamplingParams

_STOP = object()


class EngineDeadError(RuntimeError):
    pass


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = count()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="lowbit-engine", daemon=True)
        self._thread.start()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- called from the event loop
    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  stream: bool = True, prompt_text: str | None = None) -> asyncio.Queue:
        """Queues a request; raises the engine's ValueError for a bad one. Outputs arrive on the returned queue
        (stream=False: the final one only). Pass token ids (tokenized off this thread and the engine's: a text
        prompt is tokenized on the engine thread, between steps) and the text they came from as prompt_text."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        self._queues[request_id] = (loop, outputs)
        self._commands.put((self._add, (request_id, prompt, params, stream, prompt_text, loop, added)))
        try:
            await added
        except BaseException:  # refused, or the caller went away before the engine thread got to it
            self.abort(request_id)
            raise
        return outputs

    def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._commands.put((self.engine.abort, (request_id,)))

    def stream(self, request_id: str, outputs: asyncio.Queue):
        """Yields the request's RequestOutputs until the finished one; aborts it if the consumer stops early."""
        return drain(outputs, lambda: self.abort(request_id),
                     lambda e: EngineDeadError(f"the engine stopped: {e!r}"))

    async def snapshot(self) -> tuple[str, int]:
        """(Prometheus text, KV blocks in use), taken between two steps."""
        if self.error is not None:  # the thread is gone: nothing races with us
            return self._metrics()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((self._snapshot, (loop, future)))
        return await future

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")

    # ---- run on the engine thread
    def _add(self, request_id, prompt, params, stream, prompt_text, loop, added) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, stream, prompt_text)
        except Exception as e:  # handed to its caller: a ValueError is the caller's 400, anything else its 500
            loop.call_soon_threadsafe(_resolve, added, None, e)
            return
        loop.call_soon_threadsafe(_resolve, added)

    def _metrics(self) -> tuple[str, int]:
        return self.engine.metrics.render(self.engine.gauges()), self.engine.block_manager.num_used_blocks

    def _snapshot(self, loop, future) -> None:
        loop.call_soon_threadsafe(_resolve, future, self._metrics())

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        target = self._queues.get(request_id)
        if target is None:
            return
        loop, outputs = target
        if isinstance(out, BaseException) or out.finished:
            self._queues.pop(request_id, None)
        loop.call_soon_threadsafe(outputs.put_nowait, out)

    def _loop(self) -> None:
        try:
            while self._run_commands():
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out, out.request_id)
        except BaseException as e:  # fail every waiting request loudly, then stop
            self.error = e
            for request_id in list(self._queues):
                self._deliver(e, request_id)
            raise

    def _run_commands(self) -> bool:
        """Runs the queued commands (waiting for one when there is nothing to step); False on shutdown."""
        try:
            command = self._commands.get(block=not self.engine.has_unfinished())
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            fn, args = command
            fn(*args)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True


async def drain(outputs: asyncio.Queue, abort, dead=None):
    """A request's RequestOutputs from its queue until the finished one (the finished one's tokens counted for the
    access log); an exception put in the queue is raised (as dead(e) when given); abort() when the consumer stops
    early."""
    finished = False
    try:
        while not finished:
            item = await outputs.get()
            if isinstance(item, BaseException):
                if dead is None:
                    raise item
                raise dead(item) from item
            finished = item.finished
            if finished:
                count_tokens(len(item.prompt_token_ids), len(item.outputs[0].token_ids))
            yield item
    finally:
        if not finished:
            abort()
