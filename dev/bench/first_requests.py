"""Time to first token of the first single prompts a freshly built engine serves (GPU, dummy Llama-3.1-8B weights).

A prompt whose length reaches a kernel variant nothing built before pays its Triton compile inside its TTFT; the
engine's warm-up prefills (lowbit.serve.runner.kv_cache.WARM_UP_PREFILLS) exist to prevent that. Run with an empty
Triton cache to see compiles at all:
`TRITON_CACHE_DIR=$(mktemp -d) python3 dev/bench/first_requests.py [--format int4_awq] [--isl 1000,3001,700,128,300]`
Prints the build time, then per prompt (in the order given) its TTFT and median ITL over 8 output tokens.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowbit.bench_cli import int_list  # noqa: E402
from lab import load_script  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int4_awq", choices=["bf16", "fp8", "int4_awq", "nvfp4"])
    ap.add_argument("--isl", default="1000,3001,700,128,300", help="prompt lengths, served one at a time in order")
    args = ap.parse_args(argv)
    lengths = int_list(ap, "--isl", args.isl)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    bench = load_script("serve_bench.py")
    t0 = time.perf_counter()
    engine = bench.build_engine(bench.parse(["--formats", args.format, "--max-batch-size", "64"]), args.format)
    print(json.dumps({"format": args.format, "build_s": round(time.perf_counter() - t0, 1)}))
    vocab = engine.runner.model.config["vocab_size"]
    for isl in lengths:
        r = bench.latency(engine, bench.random_prompts(1, isl, vocab, isl)[0], 8)
        print(json.dumps({"isl": isl, "ttft_ms": r["ttft_ms"], "itl_ms_median": r["itl_ms_median"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
