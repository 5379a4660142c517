"""bf16 decode GEMV (lowbit.kernels.dense_gemv, M = 1) on the GPU: checked against fp32 math, then timed against
cuBLAS (F.linear) on Llama-3.1-8B's shapes, lm_head included.

`python3 bench/dense_gemv_bench.py [--configs "BN,BK,W;..."] [--reps N] [--json FILE]`
Configs: gemv_config's choice per shape (None), then --configs.
1. checks every config against x.float() @ W.float().T rounded to bf16 on fresh random inputs (the four linears,
   ragged K and odd N with bias, fp16): rel err = ||out - ref|| / ||ref||, FAIL at TOL or more (exit 1);
2. times each config and cuBLAS as CUDA-graph replays over enough weight copies that every call streams its weights
   from HBM (w4_gemv_bench's method); GB/s = weight bytes / time; per token = 32 x the four linears + lm_head.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.bench_cli import load_script  # noqa: E402
from lowbit.kernels import dense_gemv  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
          ("lm_head", 4096, 128256)]
LAYERS = 32
TOL = 2e-3  # both sides rounded to bf16: rounding flips only
CHECKS = [(4096, 6144, torch.bfloat16, False), (14336, 4096, torch.bfloat16, False), (4096 + 72, 1030, torch.bfloat16,
          True), (2000, 77, torch.float16, True)]


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(config) -> list[dict]:
    rows = []
    for k, n, dtype, bias in CHECKS:
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        ref = (x.float() @ w.float().T + (b.float() if bias else 0)).to(dtype)
        err = rel_err(dense_gemv.dense_gemv(x, w, b, config), ref)
        rows.append({"kind": "check", "config": config, "K": k, "N": n, "dtype": str(dtype)[6:], "bias": bias,
                     "rel_err": round(err, 6), "ok": err < TOL})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="", help="more configs BN,BK,W;... beside gemv_config's choice")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    w4 = load_script("w4_gemv_bench.py")
    configs = [None] + [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c.strip()]
    out = open(args.json, "w") if args.json else sys.stdout
    failed = 0
    for config in configs:
        for r in check(config):
            failed += not r["ok"]
            print(json.dumps(r), file=out)
    times = {}
    for shape, k, n in SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(w4.copies_for(2 * n * k))]
        times[shape, "cublas"] = w4.graph_time_us([lambda w=w: F.linear(x, w) for w in ws], args.reps)
        for config in configs:
            times[shape, config] = w4.graph_time_us([lambda w=w: dense_gemv.dense_gemv(x, w, None, config)
                                                     for w in ws], args.reps)
        del ws
        torch.cuda.empty_cache()
        for key in ("cublas", *configs):
            print(json.dumps({"kind": "time", "shape": shape, "K": k, "N": n, "op": key or "gemv_config", "us": round(times[shape, key], 2),
                              "GBps": round(2 * n * k / times[shape, key] / 1e3)}), file=out)
    cols = ["cublas", *configs]
    print("\n| shape | " + " | ".join(f"{c or 'gemv_config'} us (GB/s)" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for shape, k, n in SHAPES:
        print(f"| {shape} {k}->{n} | " + " | ".join(f"{times[shape, c]:.1f} ({2 * n * k / times[shape, c] / 1e3:.0f})"
                                                    for c in cols) + " |")
    per_token = {c: LAYERS * sum(times[s, c] for s, _, _ in SHAPES[:4]) / 1e3 + times["lm_head", c] / 1e3 for c in cols}
    print("| per token, ms | " + " | ".join(f"{per_token[c]:.3f}" for c in cols) + " |")
    print(f"checks failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
