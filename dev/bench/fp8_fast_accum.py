"""cuBLAS FP8 fast accumulation at prefill and large-batch M (GPU): per-tensor `torch._scaled_mm` on the four
Llama-3.1-8B linear shapes, with and without `use_fast_accum`: median us (CUDA-graph replays over weight copies
beyond L2, as dev/bench/kernels.py times) and the relative error of each against the fp32 product of the same FP8
operands. Inputs: x ~ N(0, 1) and w ~ N(0, 0.02) quantized per tensor (amax / 448).

`python3 dev/bench/fp8_fast_accum.py [--m 512,1024,8192] [--json FILE]`
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from lowbit.bench_cli import int_list
from lab import load_script

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N


def quantize(t: torch.Tensor):
    scale = t.abs().amax().float() / 448.0
    return (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def measure(kb, name: str, k: int, n: int, m: int) -> dict:
    dev = "cuda"
    x, sa = quantize(torch.randn(m, k, device=dev))
    weights = []
    for _ in range(kb.copies_for(n * k)):
        w, sb = quantize(torch.randn(n, k, device=dev) * 0.02)
        weights.append(w)
    ref = (x.float() @ weights[0].float().t()) * sa * sb
    row = {"shape": name, "M": m}
    for fast in (False, True):
        def op(w, fast=fast):
            return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        key = "fast" if fast else "exact"
        row[f"err_{key}"] = ((op(weights[0]).float() - ref).norm() / ref.norm()).item()
        row[f"us_{key}"] = round(kb.time_us([lambda w=w: op(w) for w in weights], 30), 2)
    del weights
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="256,512,1024,2048,8192")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{Path(__file__).name} needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = int_list(p, "--m", args.m)
    kb = load_script("kernels.py")
    rows = []
    print("| shape | M | exact us | fast us | speedup | rel. err exact | rel. err fast |")
    print("|---|---|---|---|---|---|---|")
    for m in ms:
        for name, (k, n) in SHAPES.items():
            r = measure(kb, name, k, n, m)
            rows.append(r)
            print(f"| {name} | {m} | {r['us_exact']} | {r['us_fast']} | {r['us_exact'] / r['us_fast']:.3f}x "
                  f"| {r['err_exact']:.2e} | {r['err_fast']:.2e} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
