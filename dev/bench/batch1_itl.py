"""Batch-1 inter-token latency of the engine (GPU, dummy Llama-3.1-8B weights): per format, build the engine as
`lowbit bench serve` does, serve one untimed prompt, then three single requests (ISL 128, OSL 256, greedy, EOS
ignored); prints each request's median ITL and their median. A / B runs: the same command on two trees, one call,
or on one tree with --set NAME=VALUE (a field of lowbit.kernels.tuning.Tuning, overridden while the engines are built
and run; repeatable).
`python3 dev/bench/batch1_itl.py [--formats bf16,int4_awq] [--isl 128] [--osl 256] [--set NAME=VALUE]`
"""
import argparse
import ast
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import load_script  # noqa: E402
from lowbit.testing.dummy_weights import FORMATS  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int4_awq")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="e.g. w4_gemv_config={'int4':(4,2048,2),'nvfp4':(4,2048,2)} (a Python literal)")
    args = ap.parse_args(argv)
    changes = dict(tuning_change(ap, item) for item in args.set)
    formats = args.formats.split(",")
    if any(f not in FORMATS for f in formats) or args.isl < 1 or args.osl < 2:
        ap.error(f"--formats from {','.join(FORMATS)}, --isl >= 1, --osl >= 2")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    sb = load_script("serve_bench.py")
    with tuning.override(**changes):
        for fmt in formats:
            itl_of_format(sb, fmt, args)
    return 0


def itl_of_format(sb, fmt, args) -> None:
    """One format's engine: an untimed prompt, then three timed requests; prints one JSON line."""
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


def tuning_change(ap, item: str) -> tuple:
    """NAME=VALUE: a Tuning field and a Python literal (else a usage error)."""
    name, _, text = item.partition("=")
    if name not in {f.name for f in dataclasses.fields(tuning.Tuning)}:
        ap.error(f"--set {item!r}: lowbit.kernels.tuning.Tuning has no field {name}")
    try:
        return name, ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        ap.error(f"--set {item!r}: {e}")


if __name__ == "__main__":
    sys.exit(main())
