"""Batch-1 inter-token latency of the engine (GPU, dummy Llama-3.1-8B weights): per format, build the engine as
`lowbit bench serve` does, serve one untimed prompt, then three single requests (ISL 128, OSL 256, greedy, EOS
ignored); prints each request's median ITL and their median. A / B runs: the same command on two trees, one call,
or on one tree with --set MODULE.NAME=VALUE (a module constant set before the engines are built; repeatable).
`python3 bench/batch1_itl.py [--formats bf16,int4_awq] [--isl 128] [--osl 256] [--set MODULE.NAME=VALUE]`
"""
import argparse
import ast
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.bench_cli import load_script  # noqa: E402
from lowbit.serve.dummy_weights import FORMATS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int4_awq")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="e.g. lowbit.kernels.w4_gemv.GEMV_CONFIG=(4,2048,2) (a Python literal)")
    args = ap.parse_args(argv)
    for item in args.set:
        set_constant(ap, item)
    formats = args.formats.split(",")
    if any(f not in FORMATS for f in formats) or args.isl < 1 or args.osl < 2:
        ap.error(f"--formats from {','.join(FORMATS)}, --isl >= 1, --osl >= 2")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    sb = load_script("serve_bench.py")
    for fmt in formats:
        engine = sb.build_engine(sb.parse(["--max-batch-size", "64"]), fmt)
        vocab = engine.runner.model.config["vocab_size"]
        sb.latency(engine, sb.random_prompts(1, args.isl, vocab, 1)[0], 16)  # untimed: first-use costs
        itl = [sb.latency(engine, sb.random_prompts(1, args.isl, vocab, 10 + i)[0], args.osl)["itl_ms_median"]
               for i in range(3)]
        median = statistics.median(itl)
        print(json.dumps({"format": fmt, "set": args.set, "itl_ms": itl, "itl_ms_median": median,
                          "tok_s": round(1e3 / median, 1)}), flush=True)
        del engine
        sb.free()
    return 0


def set_constant(ap, item: str) -> None:
    """MODULE.NAME=VALUE: an existing constant of an importable module, set to a Python literal (else a usage
    error)."""
    target, _, text = item.partition("=")
    module_name, _, name = target.rpartition(".")
    try:
        module, value = importlib.import_module(module_name), ast.literal_eval(text)
    except (ImportError, ValueError, SyntaxError) as e:
        ap.error(f"--set {item!r}: {e}")
    if not hasattr(module, name):
        ap.error(f"--set {item!r}: {module_name} has no {name}")
    setattr(module, name, value)


if __name__ == "__main__":
    sys.exit(main())
