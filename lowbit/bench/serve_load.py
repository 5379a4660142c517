"""Load test of `lowbit serve` over loopback: N concurrent streaming clients, mixed prompt and output lengths,
random client disconnects; bounded by a request count and a wall-clock limit.

    lowbit bench serve-load --clients 16 --requests 200                 # starts `lowbit serve smollm2-135m`
    lowbit bench serve-load --url http://127.0.0.1:8000 --model NAME    # an already running server

Prints throughput, TTFT and inter-token latency p50/p99, errors (other than the disconnects it caused), and the
KV blocks still in use once the server is idle (0 means every finished or aborted request freed its blocks).
With --mix: the soak of serve_mix.py (greedy requests checked against their outputs served alone, disconnects,
413s and 400s mixed in); exits non-zero on anything lost, corrupted, 5xx or KV left in use.
Uses only the standard library on the client side.
"""
import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from lowbit.bench import serve_mix
from lowbit.bench.loopback import metrics_when_idle, run_clients


@dataclass
class Result:
    ok: bool = False
    disconnected: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def one_request(host, port, body, headers, disconnect_after: int | None, timeout: float) -> Result:
    """Streams one completion; with disconnect_after, closes the socket after that many chunks."""
    res = Result()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return res
        last, chunks = None, 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                res.ok = True
                break
            event = json.loads(data)
            if "error" in event:
                res.error = event["error"]["message"]
                break
            if event.get("usage"):
                res.completion_tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    res.disconnected = True
                    break
        if not (res.ok or res.disconnected or res.error):
            res.error = "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def make_requests(args, vocab_low=100, vocab_high=40000) -> list[tuple[dict, int | None]]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        prompt = [rng.randrange(vocab_low, vocab_high) for _ in range(rng.randint(*args.prompt_len))]
        max_tokens = rng.randint(*args.output_len)
        body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                "seed": rng.randrange(1 << 30), "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        disconnect = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < args.disconnect_fraction else None
        out.append((body, disconnect))
    return out


def run_load(args, host, port) -> dict:
    work = make_requests(args)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    results: list[Result] = []
    lock = threading.Lock()
    next_index = iter(range(len(work)))
    deadline = time.perf_counter() + args.max_time

    def client():
        while time.perf_counter() < deadline:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            body, disconnect = work[i]
            r = one_request(host, port, body, headers, disconnect, timeout=max(1.0, deadline - time.perf_counter()))
            with lock:
                results.append(r)

    wall = run_clients(args.clients, client)
    m = metrics_when_idle(host, port, args.api_key)
    tokens = sum(r.completion_tokens or len(r.itls) + (r.ttft is not None) for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    itls = [x for r in results for x in r.itls]
    return {
        "requests_done": len(results), "requests_planned": len(work), "wall_s": round(wall, 1),
        "completed": sum(r.ok for r in results), "disconnected": sum(r.disconnected for r in results),
        "errors": sum(r.error is not None for r in results),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1),
        "requests_per_s": round(len(results) / wall, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "itl_p50_ms": round(1000 * percentile(itls, 50), 1), "itl_p99_ms": round(1000 * percentile(itls, 99), 1),
        "kv_blocks_used_at_end": int(m["lowbit_kv_blocks_used"]), "kv_blocks_total": int(m["lowbit_kv_blocks_total"]),
        "running_at_end": int(m["lowbit_requests_running"]), "prefix_hit_rate": m["lowbit_prefix_cache_hit_rate"],
        "preemptions": int(m["lowbit_preemptions_total"]),
    }


def start_server(args) -> tuple[subprocess.Popen, str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "lowbit.cli", "serve", args.model, "--port", str(port), *args.server_args]
    if args.mix:
        cmd += ["--max-request-bytes", str(args.max_request_bytes), "--quiet"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, "127.0.0.1", port
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("server did not come up in 300 s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="lowbit bench serve-load", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (loopback); default: start `lowbit serve MODEL` on a free port")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-time", type=float, default=900, help="seconds; clients start no request after it")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 384), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--mix", action="store_true", help="the mixed soak (serve_mix.py); --output-len's MAX is max_tokens")
    p.add_argument("--max-request-bytes", type=int, default=1 << 16,
                   help="--mix: the server's body limit (passed on when this starts it); oversized bodies exceed it")
    p.add_argument("server_args", nargs="*", help="after --: extra `lowbit serve` arguments")
    args = p.parse_args(argv)
    proc = None
    if args.url:
        u = urlparse(args.url)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("serve_load only targets loopback servers")
        host, port = u.hostname, u.port or 80
    else:
        proc, host, port = start_server(args)
    try:
        if args.mix:
            summary = serve_mix.run_mix(host, port, model=args.model, requests=args.requests, clients=args.clients,
                                        max_tokens=args.output_len[1], oversize_bytes=args.max_request_bytes + 1,
                                        seed=args.seed, api_key=args.api_key, max_time=args.max_time)
        else:
            summary = run_load(args, host, port)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.mix:
        return 1 if serve_mix.failed(summary) else 0
    return 0 if summary["errors"] == 0 and summary["kv_blocks_used_at_end"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
