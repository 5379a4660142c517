"""`lowbit bench serve-tp`: one format's engine at each tensor-parallel size on dummy weights: batch-1 latency
(TTFT, ITL) and maximum-load output throughput per GPU (NCCL on GPUs, gloo with --device cpu --tiny)."""
import argparse
import platform
import sys
from datetime import datetime, timezone

import torch

from lowbit.bench.serve_bench import TINY, DummyTokenizer, latency, offline, random_prompts
from lowbit.bench_cli import int_list, json_lines
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.testing.dummy_weights import FORMATS, PRESETS, dummy_checkpoint


def parse(argv):
    p = argparse.ArgumentParser(prog="lowbit bench serve-tp", description=__doc__)
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--formats", default="fp8,int4_awq")
    p.add_argument("--tp-sizes", default="1,2", help="tensor_parallel_size values, e.g. 1,2")
    p.add_argument("--isl", type=int, default=1000)
    p.add_argument("--osl", type=int, default=1000)
    p.add_argument("--latency-osl", type=int, default=128, help="tokens of the batch-1 run")
    p.add_argument("--num-requests", type=int, default=768)
    p.add_argument("--max-batch-size", type=int, default=512)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 config (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.tp_sizes = int_list(p, "--tp-sizes", args.tp_sizes)
    args.formats = args.formats.split(",")
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        p.error(f"--formats {','.join(unknown)}: not one of {','.join(sorted(FORMATS))}")
    return args


def build(args, fmt: str, tp: int) -> Engine:
    config = dict(PRESETS[args.model]) | ({k: TINY[k] for k in TINY if k != "architectures"} if args.tiny else {})
    ckpt = dummy_checkpoint(fmt, config, device=args.device)
    cfg = EngineConfig(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, device=args.device,
                       dtype="float32" if args.tiny else "bfloat16", tensor_parallel_size=tp)
    return Engine(ckpt.path, cfg, ckpt=ckpt, tokenizer=DummyTokenizer())


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    emit, _ = json_lines(args.json)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    emit({"bench": "serve-tp", "command": "lowbit bench serve-tp " + " ".join(argv or sys.argv[1:]),
          "machine": f"{torch.cuda.device_count()} x {gpu}" if torch.cuda.is_available() else gpu,
          "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "model": args.model})
    for fmt in args.formats:
        for tp in args.tp_sizes:
            engine = build(args, fmt, tp)
            try:
                vocab = engine.runner.model.config["vocab_size"]
                offline(engine, random_prompts(min(args.num_requests, 2 * tp), args.isl, vocab, 1), 16)  # warm-up
                lat = latency(engine, random_prompts(1, args.isl, vocab, 2)[0], args.latency_osl)
                load = offline(engine, random_prompts(args.num_requests, args.isl, vocab, 3), args.osl)
            finally:
                engine.close()
            emit({"format": fmt, "tp": tp, **{f"batch1_{k}": v for k, v in lat.items()},
                  "max_load_output_tok_s": load["output_tok_s"],
                  "max_load_output_tok_s_per_gpu": round(load["output_tok_s"] / tp, 1)})
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 0
