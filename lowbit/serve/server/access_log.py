"""One access-log line per HTTP request on stderr, written when its response has been sent:
`[lowbit] 127.0.0.1:51234 "POST /v1/completions" 200 0.412 s prompt_tokens=6 completion_tokens=8`.

A pure ASGI middleware (no task of its own), so the per-request token counter it opens in a ContextVar is the
one the endpoint and its streaming tasks see (tasks copy the context, the counter dict is shared). Requests that
produce tokens add them through `count_tokens` when their final output arrives.
"""
import sys
import time
from contextvars import ContextVar

_tokens: ContextVar[list[int] | None] = ContextVar("lowbit_request_tokens", default=None)


def count_tokens(prompt: int, completion: int) -> None:
    """Adds one finished sequence's token counts to the current request's line (no-op outside a request)."""
    counter = _tokens.get()
    if counter is not None:
        counter[0] += prompt
        counter[1] += completion


class AccessLog:
    def __init__(self, app, stream=None):
        self.app = app
        self.stream = stream

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        counter = [0, 0]
        token = _tokens.set(counter)
        status = [500]  # what the client sees when the app raises before it starts a response

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            _tokens.reset(token)
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            line = (f'[lowbit] {who} "{scope["method"]} {scope["path"]}" {status[0]} '
                    f"{time.perf_counter() - t0:.3f} s")
            if counter != [0, 0]:
                line += f" prompt_tokens={counter[0]} completion_tokens={counter[1]}"
            print(line, file=self.stream or sys.stderr, flush=True)
