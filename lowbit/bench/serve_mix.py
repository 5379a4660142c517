"""The mixed soak of `lowbit bench serve-load --mix`: normal greedy requests (streamed and not), mid-stream
disconnects, oversized bodies (413) and malformed bodies (400) interleaved, from many concurrent clients.

Each distinct prompt's greedy output is first fetched alone (one request at a time); under load every normal
request that runs to its end must return exactly that text, else it counts as corrupted. Counts: lost (no final
response: a connection error, a stream without [DONE], a body that is not JSON), corrupted, 5xx, unexpected
(a status other than the one its kind must get), the KV blocks in use once idle, and the largest gap in seconds
between two chunks of any normal stream (a stall caused by other requests' input handling shows up there).
Standard library only.
"""
import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass

from lowbit.bench.loopback import metrics_when_idle, run_clients

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The quick brown fox",
           "In 1492, Columbus", "Water boils at", "My favourite colour is", "import numpy as np\n",
           "The meaning of life is", "Roses are red,", "1, 2, 3, 4,", "Dear Sir or Madam,",
           "The best way to learn", "Photosynthesis is", "Hello, my name is", "SELECT * FROM"]
# kinds and their shares of the mix; each malformed kind is a raw body that must get a 400
MALFORMED = {
    "bad_json": lambda m: b'{"model": "%s", "prompt": "hi", "max_tokens": 4' % m.encode(),
    "nan": lambda m: b'{"model": "%s", "prompt": "hi", "max_tokens": 4, "temperature": NaN}' % m.encode(),
    "surrogate": lambda m: b'{"model": "%s", "prompt": "hi \\ud800 there", "max_tokens": 4}' % m.encode(),
    "out_of_range": lambda m: b'{"model": "%s", "prompt": "hi", "max_tokens": 1e400}' % m.encode(),
    "huge_int": lambda m: b'{"model": "%s", "prompt": "hi", "max_tokens": 99999999999999999999999999}' % m.encode(),
}
SHARES = {"stream": 0.4, "unary": 0.25, "disconnect": 0.1, "oversized": 0.1, "malformed": 0.15}


@dataclass
class Outcome:
    kind: str
    status: int | None = None  # HTTP status; None: no response
    final: bool = False  # a complete final response arrived ([DONE], a full JSON body, an error body)
    text: str | None = None  # the greedy output of a normal request that ran to its end
    prompt: str | None = None
    max_gap_s: float = 0.0  # largest gap between two chunks of a stream
    error: str | None = None


def _body(model, prompt, max_tokens, stream):
    b = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return json.dumps(b | ({"stream": True} if stream else {})).encode()


def plan(n: int, seed: int, model: str, max_tokens: int, oversize_bytes: int) -> list[tuple[str, bytes, str | None]]:
    """n (kind, raw body, prompt) triples in a seeded random order."""
    rng = random.Random(seed)
    kinds, weights = zip(*SHARES.items())
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        prompt = rng.choice(PROMPTS)
        if kind == "oversized":
            body = _body(model, "x" * oversize_bytes, max_tokens, False)
        elif kind == "malformed":
            kind = "malformed:" + rng.choice(sorted(MALFORMED))
            body = MALFORMED[kind.split(":")[1]](model)
        else:
            body = _body(model, prompt, max_tokens, kind != "unary")
        out.append((kind, body, prompt))
    return out


def send(host, port, kind, body, prompt, headers, timeout) -> Outcome:
    res = Outcome(kind, prompt=prompt)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, headers)
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200 or kind == "unary":
            data = json.loads(resp.read())
            res.final = True
            if resp.status == 200:
                res.text = data["choices"][0]["text"]
            return res
        pieces, last, chunks = [], None, 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                res.final = True
                res.text = "".join(pieces)
                break
            event = json.loads(line[6:])
            if "error" in event:
                res.final, res.error = True, event["error"]["message"]
                break
            now = time.perf_counter()
            if last is not None:
                res.max_gap_s = max(res.max_gap_s, now - last)
            last = now
            if event["choices"]:
                pieces.append(event["choices"][0]["text"])
            chunks += 1
            if kind == "disconnect" and chunks >= 2:
                conn.sock.shutdown(socket.SHUT_RDWR)
                res.final = True  # the client ended it; nothing more is owed
                break
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def expected_outputs(host, port, model, max_tokens, headers, prompts) -> dict[str, str]:
    """Each prompt's greedy output, served alone (one request at a time on an idle server)."""
    out = {}
    for p in prompts:
        r = send(host, port, "unary", _body(model, p, max_tokens, False), p, headers, 120)
        if r.status != 200:
            raise SystemExit(f"reference request for {p!r} failed: {r.status} {r.error}")
        out[p] = r.text
    return out


def run_mix(host, port, *, model, requests, clients, max_tokens, oversize_bytes, seed, api_key, max_time) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    work = plan(requests, seed, model, max_tokens, oversize_bytes)
    expected = expected_outputs(host, port, model, max_tokens, headers, sorted({p for _, _, p in work}))
    results: list[Outcome] = []
    lock = threading.Lock()
    next_index = iter(range(len(work)))
    deadline = time.perf_counter() + max_time

    def client():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            r = send(host, port, *work[i], headers, timeout=max(1.0, deadline - time.perf_counter()))
            with lock:
                results.append(r)

    wall = run_clients(clients, client)
    m = metrics_when_idle(host, port, api_key)
    want = {"stream": 200, "unary": 200, "disconnect": 200, "oversized": 413}
    lost = [r for r in results if not r.final]
    corrupted = [r for r in results if r.kind in ("stream", "unary") and r.final and r.status == 200
                 and r.text != expected[r.prompt]]
    unexpected = [r for r in results if r.status is not None and r.status != want.get(r.kind, 400)]
    gaps = [r.max_gap_s for r in results if r.kind == "stream"]
    counts: dict[str, int] = {}
    for r in results:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    return {
        "requests_planned": len(work), "requests_done": len(results), "clients": clients, "wall_s": round(wall, 1),
        "kinds": dict(sorted(counts.items())), "distinct_prompts": len(expected),
        "lost": len(lost), "corrupted": len(corrupted), "status_5xx": sum((r.status or 0) >= 500 for r in results),
        "unexpected_status": len(unexpected), "stream_errors": sum(r.error is not None and r.final for r in results),
        "max_stream_gap_s": round(max(gaps, default=0.0), 3),
        "kv_blocks_used_at_end": int(m["lowbit_kv_blocks_used"]), "running_at_end": int(m["lowbit_requests_running"]),
        "samples": sorted({f"{r.kind} {r.status} {r.error or ''} {r.text!r}"[:200]
                           for r in lost + corrupted + unexpected})[:5],
    }


def failed(summary: dict) -> bool:
    """The soak's pass rule: nothing lost or corrupted, no 5xx, no wrong status, every KV block freed."""
    return bool(summary["lost"] or summary["corrupted"] or summary["status_5xx"] or summary["unexpected_status"]
                or summary["stream_errors"] or summary["kv_blocks_used_at_end"] or summary["running_at_end"])
