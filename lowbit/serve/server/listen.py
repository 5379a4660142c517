"""The server's listening socket, bound before the model loads so a bad host or a busy port fails in a second.

Bound, not listening: uvicorn listens on it once the app is ready, so a client meanwhile is refused rather than
left waiting (as vLLM does it).
"""
import errno
import socket

from lowbit.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = ": another process uses it (choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from e
    return sock
