"""`lowbit bench serve-prefix`: time to first token of a long shared prefix that other traffic pushed out of a small
device KV pool, recomputed (host cache off) vs copied back from host memory (`host_cache_size`), on dummy weights.

Per repeat, with a fresh prefix: `cold` (the prefix computed), `device_hit` (again at once: found in the device
pool, the floor), then traffic that hands every device block out again, then `after_eviction` (a new suffix on the
same prefix): recomputed with the host cache off, restored with it on. Each engine's pool holds the prefix plus a
little; the same dummy weights on both sides, and the first tokens after eviction are compared.
"""
import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from lowbit.bench.serve_bench import LLAMA_3_1_8B, TINY, DummyTokenizer, free, sync
from lowbit.bench_cli import json_lines
from lowbit.serve.engine.config import EngineConfig, parse_bytes
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.testing.dummy_weights import FORMATS, dummy_checkpoint

BLOCK = 16


def parse(argv):
    p = argparse.ArgumentParser(prog="lowbit bench serve-prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="fp8", choices=sorted(FORMATS))
    p.add_argument("--prefix-len", type=int, default=8192, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="tokens after the prefix, new each request")
    p.add_argument("--traffic-len", type=int, default=2048, help="prompt tokens of each traffic request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--host-cache-size", help="bytes (e.g. 8GiB; default: twice the device pool)")
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 model (CPU smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the JSON lines here")
    args = p.parse_args(argv)
    for flag in ("prefix_len", "suffix_len", "traffic_len", "repeats", "max_num_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    try:
        args.host_bytes = parse_bytes("--host-cache-size", args.host_cache_size or 0)
    except ValueError as e:
        p.error(str(e))
    return args


def build(args, host_cache_size: int) -> Engine:
    config = dict(TINY if args.tiny else LLAMA_3_1_8B)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 2 * args.prefix_len)
    ckpt = dummy_checkpoint(args.format, config, device=args.device)
    pool = -(-(args.prefix_len + args.suffix_len + BLOCK) // BLOCK) + 16  # the prefix and a little more
    cfg = EngineConfig(max_batch_size=8, max_num_tokens=args.max_num_tokens, num_kv_blocks=pool, block_size=BLOCK,
                       device=args.device, dtype="float32" if args.tiny else "bfloat16",
                       host_cache_size=host_cache_size)
    with torch.device(args.device):
        return Engine(ckpt.path, cfg, ckpt=ckpt, tokenizer=DummyTokenizer())


def first_token(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, the token) of one request alone."""
    sync()
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                dt = time.perf_counter() - t0
                while engine.has_unfinished():
                    engine.step()
                return dt, out.outputs[0].token_ids[0]
    raise RuntimeError(f"{request_id} gave no token")


def traffic(engine: Engine, args, gen: torch.Generator, tag: str) -> None:
    """Requests of fresh tokens whose blocks add up to more than the pool: every device block is handed out again."""
    vocab = engine.runner.model.config["vocab_size"]
    length = min(args.traffic_len, engine.max_model_len - 1)
    n = -(-engine.block_manager.num_blocks * BLOCK // length) + 1
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"{tag}-t{i}", torch.randint(0, vocab, (length,), generator=gen).tolist(), params)
    while engine.has_unfinished():
        engine.step()


def measure(engine: Engine, args) -> dict:
    vocab = engine.runner.model.config["vocab_size"]
    gen = torch.Generator().manual_seed(0)  # both engines see the same prompts
    draw = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    times = {"cold": [], "device_hit": [], "after_eviction": []}
    tokens, bm = [], engine.block_manager
    for r in range(-1, args.repeats):  # repeat -1 warms up every shape (compiles kernels), not recorded
        prefix = draw(args.prefix_len)
        cold = first_token(engine, f"r{r}-cold", prefix + draw(args.suffix_len))[0]
        hit = first_token(engine, f"r{r}-hit", prefix + draw(args.suffix_len))[0]
        traffic(engine, args, gen, f"r{r}")
        hits_before = bm.num_host_hit_tokens
        after, token = first_token(engine, f"r{r}-after", prefix + draw(args.suffix_len))
        if r >= 0:
            for key, value in zip(times, (cold, hit, after)):
                times[key].append(value)
            tokens.append(token)
    return {"ttft_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()},
            "host_hit_tokens_last": bm.num_host_hit_tokens - hits_before, "tokens": tokens,
            "offloaded_blocks": bm.num_offloaded, "restored_blocks": bm.num_restored}


def main(argv=None) -> int:
    args = parse(argv)
    argv = sys.argv[1:] if argv is None else argv
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"command: lowbit bench serve-prefix {' '.join(argv)}")
    print(f"machine: {device}, torch {torch.__version__}")
    print(f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    emit, _ = json_lines(args.json)
    engine = build(args, 0)
    pool_bytes = engine.block_manager.num_blocks * sum(m.kv_cache[:, 0].nbytes for m in engine.runner.attn_layers)
    host_bytes = args.host_bytes or 2 * pool_bytes
    off = measure(engine, args)
    del engine
    free()
    engine = build(args, host_bytes)
    on = measure(engine, args)
    del engine
    free()
    model = "tiny" if args.tiny else "Llama-3.1-8B shapes, dummy weights"
    same = sum(a == b for a, b in zip(off["tokens"], on["tokens"]))
    emit({"bench": "serve-prefix", "model": model, "format": args.format, "prefix_len": args.prefix_len,
          "suffix_len": args.suffix_len, "device_pool_mib": round(pool_bytes / 2**20, 1),
          "host_cache_mib": round(host_bytes / 2**20, 1), "repeats": args.repeats,
          "ttft_ms_cold": off["ttft_ms"]["cold"], "ttft_ms_device_hit": off["ttft_ms"]["device_hit"],
          "ttft_ms_evicted_host_off": off["ttft_ms"]["after_eviction"],
          "ttft_ms_evicted_host_on": on["ttft_ms"]["after_eviction"],
          "host_hit_tokens": on["host_hit_tokens_last"], "restored_blocks": on["restored_blocks"],
          "offloaded_blocks": on["offloaded_blocks"], "same_first_tokens": f"{same}/{len(off['tokens'])}"})
    print(f"| prefix | cold (recompute) | device hit | evicted, host cache off | evicted, host cache on |\n"
          f"|---|---|---|---|---|\n| {args.prefix_len} + {args.suffix_len} tokens, {args.format} | "
          f"{off['ttft_ms']['cold']:.1f} ms | {off['ttft_ms']['device_hit']:.1f} ms | "
          f"{off['ttft_ms']['after_eviction']:.1f} ms | {on['ttft_ms']['after_eviction']:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
