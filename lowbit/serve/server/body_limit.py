"""A request-body size limit as plain ASGI middleware: 413 in OpenAI's error shape, before the body is parsed.

A body with a Content-Length over the limit is refused from the header, before a byte of it is read; one without
(chunked) is read up to the limit and refused as soon as it goes over, else handed on as read. After the 413's
head, up to DRAIN_BYTES more of the body are read and dropped, so that a client that sends its whole body before
reading the answer (most do) gets the 413 rather than a reset connection. No HTTP framework imports here.
"""
import json

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: a full 128k-token context as text or ids, several times over
DRAIN_BYTES = 64 << 20  # of a refused body, read and dropped before the connection closes


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class BodySizeLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await self._refuse(send, 400, "Content-Length is not a number", "invalid_content_length")
            if n > self.max_bytes:
                return await self._refuse_size(send, n, receive)
            return await self.app(scope, receive, send)
        if headers.get(b"transfer-encoding") is None:  # no body
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:  # chunked: buffer what comes (at most max_bytes), then replay it to the app
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse_size(send, None, receive)
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        return await self.app(scope, replay, send)

    async def _refuse_size(self, send, n: int | None, receive) -> None:
        got = f"{n} bytes" if n is not None else "more"
        await self._refuse(send, 413, f"the request body has {got}; this server takes at most {self.max_bytes} "
                                      f"bytes (lowbit serve --max-request-bytes)", "request_too_large", receive)

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str, receive=None) -> None:
        body = _error(message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": receive is not None})
        if receive is None:
            return
        dropped = 0  # the server reads nothing of a request once its response is complete: drain first
        while dropped < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                break
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.body", "body": b""})
