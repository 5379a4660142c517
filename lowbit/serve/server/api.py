"""OpenAI-compatible HTTP API on FastAPI: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

The only module that imports FastAPI (and, through protocol.py, pydantic).
"""
import asyncio
import copy
import dataclasses
import json
import time
from functools import lru_cache

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from lowbit.serve.server.access_log import AccessLog
from lowbit.serve.server.async_engine import AsyncEngine, EngineDeadError
from lowbit.serve.server.auth import bearer_matches
from lowbit.serve.engine.engine import ContextLengthError
from lowbit.serve.engine.outputs import RequestOutput
from lowbit.serve.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from lowbit.serve.server.inputs import PromptError, PromptProcessor
from lowbit.serve.server.protocol import APIError, ChatRequest, CompletionRequest, ErrorResponse
from lowbit.serve.engine import structured
from lowbit.serve.server import structured_output

# The responses each endpoint documents in the OpenAPI schema besides its 200 (FastAPI's 422 is never sent:
# validation errors are 400s).
_ERRORS = {400: "Invalid request (OpenAI's error shape)", 401: "Missing or wrong API key",
           404: "Unknown model or path", 413: "Request body over --max-request-bytes"}
_STREAM_200 = {200: {"description": "JSON, or server-sent events of JSON chunks when stream is true",
                     "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _responses(*codes: int) -> dict:
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, public_metrics: bool = False,
              access_log: bool = True, max_request_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """api_key: required on /v1/* and, unless public_metrics, on /metrics (/health stays open for probes).
    access_log: one line per request on stderr (access_log.py). max_request_bytes: larger bodies get a 413."""
    app = FastAPI(title="lowbit", docs_url=None, redoc_url=None)
    api = OpenAIServer(engine, model_name)
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if access_log:
        app.add_middleware(AccessLog)
    _document_real_errors(app, engine.engine.runner.model.config["vocab_size"], engine.engine.max_model_len)

    def authorize(request: Request) -> None:
        if api_key is not None and not bearer_matches(request.headers.get("authorization"), api_key):
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key")

    auth = [Depends(authorize)]
    app.get("/health", responses={503: {"description": "The engine stopped"}})(api.health)
    app.get("/metrics", response_class=PlainTextResponse, dependencies=[] if public_metrics else auth,
            responses=_responses(401))(api.metrics)
    app.get("/v1/models", dependencies=auth, responses=_responses(401))(api.models)
    app.post("/v1/completions", dependencies=auth, responses=_STREAM_200 | _responses(400, 401, 404, 413)
             )(api.completions)
    app.post("/v1/chat/completions", dependencies=auth, responses=_STREAM_200 | _responses(400, 401, 404, 413)
             )(api.chat)
    return app


def _document_real_errors(app: FastAPI, vocab_size: int, max_model_len: int) -> None:
    """The published schema without FastAPI's 422 (the server answers 400 in OpenAI's shape instead), and with
    this model's bounds: token ids in prompts, and max_tokens up to the context length."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            _exact_integer_bounds(schema)
            bodies = schema["components"]["schemas"]
            _integer_bound(bodies["CompletionRequest"]["properties"]["prompt"], vocab_size - 1)
            for body, field in (("CompletionRequest", "max_tokens"), ("ChatRequest", "max_tokens"),
                                ("ChatRequest", "max_completion_tokens")):
                _integer_bound(bodies[body]["properties"][field], max_model_len)
        return app.openapi_schema
    app.openapi = openapi


def _integer_bound(node, maximum: int) -> None:
    """Every integer in this field's schema gets `maximum` (token ids in a prompt, a max_tokens)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = maximum
        for value in node.values():
            _integer_bound(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _integer_bound(value, maximum)


def _exact_integer_bounds(node) -> None:
    """FastAPI's OpenAPI model stores bounds as floats (2**64 as 1.8446744073709552e+19), which clients read as
    inexact; integer fields get them back as JSON integers. Every such bound here is a power of two or small, so
    the float holds it exactly."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_integer_bounds(value)


class _ErrorJSON(JSONResponse):
    """JSON as ASCII: an error message may quote text that is not valid Unicode (a lone surrogate)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode()


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return _ErrorJSON(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = e.errors()[0]
        # pydantic's union / validator steps ("function-after[...]", "list[int]") are no field names
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not any(c in str(x) for c in "[-")]
        message = f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg"))
        return _ErrorJSON(APIError(400, message, param=loc[0] if loc else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # e.headers: a 405's Allow header
        return _ErrorJSON(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code,
                          headers=getattr(e, "headers", None))


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _merge(streams, request: Request | None = None):
    """(index, output) from several async generators as they come; cancelling this cancels (and aborts) all,
    and so does the client of `request` going away (checked once a second)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while remaining:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                item = None
            if request is not None and loop.time() - checked >= 1.0:
                checked = loop.time()
                if await request.is_disconnected():
                    return
            if item is None:
                continue
            i, out, error = item
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = copy.deepcopy(engine.engine.tokenizer)  # the engine thread's own one is never shared
        self.token_text = lru_cache(maxsize=65536)(lambda i: self.tokenizer.decode([i]))
        self.inputs = PromptProcessor(engine.engine)  # templating and tokenization on worker threads

    # ---- plain endpoints
    async def health(self):
        if self.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(self.engine.error)}, status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        text, _ = await self.engine.snapshot()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(self):
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "lowbit",
                "max_model_len": self.engine.engine.max_model_len}
        return {"object": "list", "data": [card]}

    # ---- shared plumbing
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found")

    def _check_max_tokens(self, params, param: str) -> None:
        """max_tokens beyond the whole context: 400 (within it, the engine stops at the context end: 'length')."""
        if params.max_tokens is not None and params.max_tokens > self.engine.engine.max_model_len:
            raise APIError(400, f"max_tokens is {params.max_tokens}; this model's context is "
                                f"{self.engine.engine.max_model_len} tokens", param=param)

    async def _prepared(self, prepare, *args):
        """Runs an input-preparation coroutine of PromptProcessor; its PromptError -> 400."""
        try:
            return await prepare(*args)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from e

    async def _submit(self, prefix: str, prompts: list, copies: list, stream: bool) -> tuple[str, list]:
        """Adds one engine request per (token ids, text or None) and choice (`copies`: each choice's params, n of
        them); returns (response id, [stream]) in choice-index order (prompt-major). Bad prompts: 400, nothing left.
        stream=False: each request's stream yields its final output only."""
        rid = self.engine.new_request_id(prefix)
        streams = []
        try:
            requests = [(ids, text, params) for ids, text in prompts for params in copies]
            for i, (ids, text, params) in enumerate(requests):
                outputs = await self.engine.add(f"{rid}-{i}", ids, params, stream, prompt_text=text)
                streams.append(self.engine.stream(f"{rid}-{i}", outputs))
        except ValueError as e:
            for i in range(len(streams)):
                self.engine.abort(f"{rid}-{i}")
            code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
            raise APIError(400, str(e), param="prompt" if prefix == "cmpl" else "messages", code=code) from e
        except EngineDeadError as e:
            raise APIError(500, str(e), "server_error") from e
        return rid, streams

    async def _constrain(self, params, spec, param: str):
        """params with the structured-output spec, compiled here off the engine thread (the engine finds it in
        the cache); 400 when xgrammar is missing or cannot compile the schema."""
        if spec is None:
            return params
        if not structured.available():
            raise APIError(400, structured.MISSING, param=param)
        try:
            await asyncio.to_thread(self.engine.engine.grammars.compile, spec)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e
        return dataclasses.replace(params, structured=spec)

    @staticmethod
    async def _finals(streams, request: Request) -> list[RequestOutput]:
        """The last output of each stream; a client that disconnects meanwhile aborts them all (499)."""
        finals = [None] * len(streams)
        async for i, out in _merge(streams, request):
            finals[i] = out
        if any(f is None or not f.finished for f in finals):
            raise APIError(499, "client closed the request", code="client_closed_request")
        return finals

    def _stream(self, events) -> StreamingResponse:
        async def body():
            try:
                async for payload in events:
                    yield _sse(payload)
            except EngineDeadError as e:
                yield _sse(APIError(500, str(e), "server_error").body())
            yield _sse("[DONE]")
        return StreamingResponse(body(), media_type="text/event-stream")

    @staticmethod
    def _usage(outs: list[RequestOutput], n: int = 1) -> dict:
        """Token counts; the n choices of one prompt count its tokens once (as OpenAI does)."""
        prompt = sum(len(o.prompt_token_ids) for o in outs[::n])
        completion = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- /v1/completions
    async def completions(self, req: CompletionRequest, request: Request):
        self._check_model(req.model)
        params = req.params()
        self._check_max_tokens(params, "max_tokens")
        params = await self._constrain(params, structured_output.response_format_spec(req.response_format),
                                       "response_format")
        prompts = await self._prepared(self.inputs.completion, req.prompts())
        rid, streams = await self._submit("cmpl", prompts, req.copies(params), req.stream)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self._stream(self._completion_events(req, head, streams))
        try:
            finals = await self._finals(streams, request)
        except EngineDeadError as e:
            raise APIError(500, str(e), "server_error") from e
        choices = [self._completion_choice(i, o, req) for i, o in enumerate(finals)]
        return head | {"choices": choices, "usage": self._usage(finals, req.n)}

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _completion_choice(self, i: int, out: RequestOutput, req: CompletionRequest) -> dict:
        c = out.outputs[0]
        prefix = self._prompt_text(out) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            ids, entries = list(c.token_ids), list(c.logprobs)
            if req.echo:
                ids, entries = out.prompt_token_ids + ids, out.prompt_logprobs + entries
            logprobs = self._legacy_logprobs(ids, entries, 0)
        return {"index": i, "text": prefix + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _legacy_logprobs(self, ids: list[int], entries: list, offset: int) -> dict:
        tokens = [self.token_text(i) for i in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top = []
        for i, e in zip(ids, entries):
            top.append(None if e is None else {self.token_text(t): lp for t, lp in e[1]} | {self.token_text(i): e[0]})
        return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    async def _completion_events(self, req: CompletionRequest, head: dict, streams):
        finals, sent = [None] * len(streams), [0] * len(streams)
        async for i, out in _merge(streams):
            text, logprobs = out.delta_text, None
            if req.echo and sent[i] == 0:
                text = self._prompt_text(out) + text
            if req.logprobs is not None:
                logprobs = self._legacy_logprobs(out.delta_token_ids, out.delta_logprobs, sent[i])
            sent[i] += len(text)
            finals[i] = out if out.finished else None
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": out.outputs[0].finish_reason}
            yield head | {"choices": [choice]}
        if req.stream_options and req.stream_options.include_usage:
            yield head | {"choices": [], "usage": self._usage(finals, req.n)}

    # ---- /v1/chat/completions
    async def chat(self, req: ChatRequest, request: Request):
        self._check_model(req.model)
        params = req.params()
        self._check_max_tokens(params, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        params, tool_spec = await self._chat_structure(req, params, messages)
        ids = await self._prepared(self.inputs.chat, messages)
        rid, streams = await self._submit("chatcmpl", [(ids, None)], req.copies(params), req.stream)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self._stream(self._chat_events(req, head | {"object": "chat.completion.chunk"}, streams,
                                                  tool_spec))
        try:
            finals = await self._finals(streams, request)
        except EngineDeadError as e:
            raise APIError(500, str(e), "server_error") from e
        choices = [self._chat_choice(i, out.outputs[0], req, tool_spec) for i, out in enumerate(finals)]
        return head | {"choices": choices, "usage": self._usage(finals, req.n)}

    def _chat_choice(self, i: int, c, req: ChatRequest, tool_spec) -> dict:
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if tool_spec is not None:
            message, reason = self._tool_message(c.text, c.finish_reason, tool_spec)
        return {"index": i, "message": message,
                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs) if req.logprobs else None,
                "finish_reason": reason}

    async def _chat_structure(self, req: ChatRequest, params, messages: list[dict]):
        """response_format or tools -> (params with their grammar, the spec when the output holds tool calls);
        describes the tools in a system message and writes earlier calls back into the assistants' texts."""
        for m, source in zip(messages, req.messages):
            for call in source.tool_calls or []:
                f = call.get("function", {}) if isinstance(call, dict) else {}
                m["content"] += (f'{structured.TOOL_BEGIN}{{"name": {json.dumps(f.get("name"))}, "arguments": '
                                 f'{f.get("arguments") or "{}"}}}{structured.TOOL_END}')
        tools = structured_output.function_tools(req.tools)
        tool_spec = structured_output.tools_spec(tools, req.tool_choice, req.parallel_tool_calls)
        format_spec = structured_output.response_format_spec(req.response_format)
        if tool_spec is not None and format_spec is not None:
            raise APIError(400, "response_format cannot be combined with tool calls (use tool_choice 'none')",
                           param="response_format")
        if tools:
            at = 1 if messages and messages[0]["role"] == "system" else 0
            text = structured_output.tools_prompt(tools, tool_spec)
            if at:
                messages[0]["content"] += "\n\n" + text
            else:
                messages.insert(0, {"role": "system", "content": text})
        spec = tool_spec or format_spec
        params = await self._constrain(params, spec, "tools" if tool_spec is not None else "response_format")
        return params, tool_spec

    @staticmethod
    def _tool_message(text: str, reason: str | None, spec) -> tuple[dict, str | None]:
        """A tool-mode output -> (the assistant message with its tool_calls, finish_reason)."""
        content, calls = structured_output.tool_calls(text, spec)
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        return message, "tool_calls" if calls and reason == "stop" else reason

    def _chat_logprobs(self, ids: list[int], entries: list) -> dict:
        def item(t, lp):
            s = self.token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [item(i, e[0]) | {"top_logprobs": [item(t, lp) for t, lp in e[1]]}
                            for i, e in zip(ids, entries)]}

    async def _chat_events(self, req: ChatRequest, head: dict, streams: list, tool_spec=None):
        """SSE chunks of the n choices as they come; with tool calls possible (tool_spec) each choice's text is held
        back and sent parsed in its last chunk."""
        for i in range(len(streams)):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield head | {"choices": [first]}
        finals, held = [None] * len(streams), [[] for _ in streams]
        async for i, out in _merge(streams):
            reason = out.outputs[0].finish_reason
            delta = {"content": out.delta_text} if out.delta_text else {}
            if tool_spec is not None:
                held[i].append(out.delta_text)
                delta = {}
                if reason:
                    message, reason = self._tool_message("".join(held[i]), reason, tool_spec)
                    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                    for k, call in enumerate(delta.get("tool_calls", [])):
                        call["index"] = k
            logprobs = self._chat_logprobs(out.delta_token_ids, out.delta_logprobs) if req.logprobs else None
            if delta or reason:
                yield head | {"choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
            finals[i] = out
        if req.stream_options and req.stream_options.include_usage:
            yield head | {"choices": [], "usage": self._usage(finals, req.n)}
