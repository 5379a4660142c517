"""`lowbit serve NAME`: load a checkpoint by name and serve it with the OpenAI-compatible API."""
import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path

from lowbit.errors import UserError
from lowbit.progress import stage
from lowbit.serve.server.auth import api_key_from
from lowbit.serve.server.listen import bind

EXAMPLES = """examples:
  lowbit serve smollm2-135m                        # the embedded model on http://127.0.0.1:8000/v1
  LOWBIT_API_KEY=secret lowbit serve smollm2-135m-fp8 --port 8001   # or --api-key-file key.txt
  lowbit serve ./my-checkpoint --max-batch-size 32 --max-num-tokens 1024
  lowbit serve smollm2-135m --config extra.yaml    # any EngineConfig field, e.g. num_kv_blocks: 512
  lowbit serve smollm2-135m --speculative ngram --num-draft-tokens 4

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8}'
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="NAME", help="store name, checkpoint directory or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, help="sequences in flight (default 64)")
    parser.add_argument("--max-num-tokens", type=int, help="tokens computed per step (default 2048)")
    parser.add_argument("--kv-cache-fraction", type=float,
                        help="share of free GPU memory (default 0.9) or available RAM on CPU (default 0.05) for KV")
    parser.add_argument("--host-cache-size", metavar="BYTES",
                        help="host memory for KV blocks evicted from the prefix cache, e.g. 16GiB (default 0: off)")
    parser.add_argument("--speculative", choices=["ngram", "draft"],
                        help="speculative decoding: n-gram prompt lookup, or a draft model (--draft-model)")
    parser.add_argument("--draft-model", metavar="NAME", help="the drafting model (same vocabulary as NAME)")
    parser.add_argument("--num-draft-tokens", type=int, metavar="K", help="most tokens drafted per sequence and step "
                        "(default 8 for ngram, 4 for draft)")
    parser.add_argument("--tp-size", dest="tensor_parallel_size", type=int, metavar="N",
                        help="split the model over N ranks, one process (and GPU) each (default 1)")
    parser.add_argument("--dp-size", dest="data_parallel_size", type=int, metavar="N",
                        help="N replicas of the model (each --tp-size GPUs) behind this server, requests routed by "
                             "load and prompt prefix (default 1)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (visible in the "
                        "process list: prefer --api-key-file or $LOWBIT_API_KEY)")
    parser.add_argument("--api-key-file", type=Path, metavar="PATH", help="read the key from the first line of PATH")
    parser.add_argument("--public-metrics", action="store_true", help="serve /metrics without the key")
    parser.add_argument("--quiet", action="store_true", help="no access log line per request")
    parser.add_argument("--config", type=Path, help="YAML file of further engine settings (EngineConfig fields)")
    parser.add_argument("--max-request-bytes", type=int, default=8 << 20,
                        help="largest request body taken; larger ones get 413 (default 8 MiB)")


def engine_config(args):
    import yaml

    from lowbit.serve.engine.config import EngineConfig

    values = {}
    if args.config is not None:
        if not args.config.is_file():
            raise UserError(f"config file {args.config} does not exist")
        values = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(values, dict):
            raise UserError(f"{args.config}: expected a mapping of engine settings")
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
    try:
        return EngineConfig.from_dict(values)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from e


def run(args) -> int:
    # Everything the user typed is checked, and the port taken, before the slow part (imports, model load).
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: not a TCP port (1-65535)")
    if args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be positive, not {args.max_request_bytes}")
    api_key = api_key_from(args.api_key, args.api_key_file)
    config = engine_config(args)
    sock = bind(args.host, args.port)
    try:
        return _serve(args, config, api_key, sock)
    finally:
        sock.close()


def _serve(args, config, api_key: str | None, sock) -> int:
    with stage("importing the engine and the HTTP server"):
        try:
            import uvicorn

            from lowbit.serve.server.api import build_app
        except ImportError as e:
            raise UserError(f"serving over HTTP needs the serve extra: pip install 'lowbit[serve]' ({e})") from e
        from lowbit.serve.server.async_engine import AsyncEngine
        from lowbit.serve.engine.engine import Engine
        from lowbit.serve.distributed.runner import RankFailure

    if config.data_parallel_size > 1:
        return _serve_replicas(args, config, api_key, sock, uvicorn, build_app)
    try:
        with stage(f"loading {args.model}"):
            engine = Engine(args.model, config)
    except (ValueError, RankFailure) as e:  # unsupported architecture, format or dtype; a rank that failed to load
        raise UserError(str(e)) from e
    if config.tensor_parallel_size > 1:
        engine.runner.on_failure = _exit_on_rank_failure  # a dead rank ends the server, not only the engine thread
    print(f"[lowbit] {args.model}: {engine.runner.num_blocks} KV blocks of {config.block_size} tokens "
          f"({engine.runner.kv_dtype}), context {engine.max_model_len}, on {engine.runner.device}", flush=True)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, args.model, api_key, public_metrics=args.public_metrics, access_log=not args.quiet,
                    max_request_bytes=args.max_request_bytes)
    auth = "no API key" if api_key is None else \
        ("API key on /v1/*" if args.public_metrics else "API key on /v1/* and /metrics")
    print(f"[lowbit] serving {args.model} on http://{args.host}:{args.port}/v1 ({auth})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
    async_engine.shutdown()
    engine.close()
    return 0


def _serve_replicas(args, config, api_key: str | None, sock, uvicorn, build_app) -> int:
    """--dp-size N: a replica that dies fails its requests (500), the server stops taking new ones, lets the other
    replicas' requests finish (30 s at most) and exits 1."""
    from lowbit.serve.server.dp_engine import DataParallelEngine

    server = None
    failed = []

    def on_failure(line: str) -> None:
        print(f"error: {line}; stopping", file=sys.stderr, flush=True)
        failed.append(line)
        if server is not None:
            server.should_exit = True

    try:
        with stage(f"loading {args.model} x {config.data_parallel_size} replicas"):
            engine = DataParallelEngine(args.model, config, on_failure=on_failure)
    except ValueError as e:  # a replica that failed to load, or too few GPUs
        raise UserError(str(e)) from e
    for i, info in enumerate(engine.infos):
        print(f"[lowbit] {args.model} replica {i}: {info['num_blocks']} KV blocks of {config.block_size} tokens "
              f"({info['kv_dtype']}), context {info['max_model_len']}, on {info['device']}", flush=True)
    app = build_app(engine, args.model, api_key, public_metrics=args.public_metrics, access_log=not args.quiet,
                    max_request_bytes=args.max_request_bytes)
    print(f"[lowbit] serving {args.model} on http://{args.host}:{args.port}/v1 "
          f"({config.data_parallel_size} replicas)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=30))
    if failed:
        server.should_exit = True
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return 1 if failed else 0


def _exit_on_rank_failure(line: str) -> None:
    """Called on the watchdog thread: one line, exit 1 (requests in flight get their connections closed)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    os._exit(1)
