"""bf16 decode GEMV (lowbit.kernels.linear.dense_gemv, M = 1) on the GPU: checked against fp32 math, then timed against
cuBLAS (F.linear) on Llama-3.1-8B's shapes, lm_head included. --fp8: the FP8 GEMV (fp8_gemv: FP8 x and weights,
per-tensor scales) against scaled_gemm_ref, timed against the tensor-core route of an FP8 linear at M = 1
(w8a8.tensor_core_linear: fp8_small_m or torch._scaled_mm; the engine runs fp8_gemv on layers up to
w8a8.FP8_GEMV_MAX_WEIGHTS); lm_head stays bf16 in FP8 checkpoints and is left out.

`python3 dev/bench/dense_gemv_bench.py [--fp8] [--configs "BN,BK,W;..."] [--reps N] [--json FILE]`
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import dense_gemv, w8a8  # noqa: E402
from lowbit.kernels.linear.scaled_gemm import scaled_gemm_ref  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
          ("lm_head", 4096, 128256)]
LAYERS = 32
TOL = 2e-3  # both sides rounded to bf16: rounding flips only
CHECKS = [(4096, 6144, torch.bfloat16, False), (14336, 4096, torch.bfloat16, False), (4096 + 72, 1030, torch.bfloat16,
          True), (2000, 77, torch.float16, True)]  # K, N, x dtype, bias
FP8_CHECKS = [(4096, 6144, False), (14336, 4096, False), (4096 + 72, 1030, True), (2000, 77, True)]  # K, N, row scales


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_fp8(config) -> list[dict]:
    rows = []
    for k, n, row_scales in FP8_CHECKS:
        q = (torch.randn(1, k, device="cuda") * 20).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device="cuda") * 20).to(torch.float8_e4m3fn)
        sa = torch.tensor(0.01, device="cuda")
        sb = torch.rand(n, device="cuda") * 1e-3 + 1e-4 if row_scales else torch.tensor(3e-4, device="cuda")
        ref = scaled_gemm_ref(q, w, sa, sb, None, torch.bfloat16)
        err = rel_err(dense_gemv.fp8_gemv(q, w, sa, sb, None, torch.bfloat16, config), ref)
        rows.append({"kind": "check", "config": config, "K": k, "N": n, "fmt": "fp8", "row_scales": row_scales,
                     "rel_err": round(err, 6), "ok": err < TOL})
    return rows


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


def time_shape(shape, k, n, configs, fp8: bool, reps: int, w4) -> dict:
    """us per call of the baseline and of each config, over enough weight copies to stream from HBM."""
    if fp8:
        x = (torch.randn(1, k, device="cuda") * 20).to(torch.float8_e4m3fn)
        ws = [(torch.randn(n, k, device="cuda") * 20).to(torch.float8_e4m3fn) for _ in range(w4.copies_for(n * k))]
        sa, sb = torch.tensor(0.01, device="cuda"), torch.tensor(3e-4, device="cuda")
        baseline = lambda w: w8a8.tensor_core_linear(x, w, sb, sa, None, torch.bfloat16)  # noqa: E731
        gemv = lambda w, c: dense_gemv.fp8_gemv(x, w, sa, sb, None, torch.bfloat16, c)  # noqa: E731
    else:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(w4.copies_for(2 * n * k))]
        baseline = lambda w: F.linear(x, w)  # noqa: E731
        gemv = lambda w, c: dense_gemv.dense_gemv(x, w, None, c)  # noqa: E731
    times = {(shape, "baseline"): w4.graph_time_us([lambda w=w: baseline(w) for w in ws], reps)}
    for config in configs:
        times[shape, config] = w4.graph_time_us([lambda w=w, c=config: gemv(w, c) for w in ws], reps)
    del ws
    torch.cuda.empty_cache()
    return times


def parse_config(ap, text: str, vec: int) -> tuple[int, int, int]:
    """'BN,BK,W' -> (BN, BK, W): BN a power of two, BK a multiple of vec x 32 x W (16-byte chunks over the threads);
    anything else is a usage error (one line, exit 2)."""
    try:
        bn, bk, w = (int(v) for v in text.split(","))
    except ValueError:
        ap.error(f"--configs {text!r}: expected BN,BK,W (three integers)")
    if bn < 1 or bn & (bn - 1) or w < 1 or bk % (vec * 32 * w):
        ap.error(f"--configs {text!r}: BN a power of two, BK a multiple of {vec} x 32 x W")
    return bn, bk, w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="", help="more configs BN,BK,W;... beside gemv_config's choice")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fp8", action="store_true", help="the FP8 GEMV against the engine's FP8 route at M = 1")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    configs = [None] + [parse_config(ap, c, 16 // (1 if args.fp8 else 2)) for c in args.configs.split(";") if c.strip()]
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    w4 = load_script("w4_gemv_bench.py")
    out = open(args.json, "w") if args.json else sys.stdout
    failed = 0
    shapes = SHAPES[:4] if args.fp8 else SHAPES
    for config in configs:
        for r in (check_fp8(config) if args.fp8 else check(config)):
            failed += not r["ok"]
            print(json.dumps(r), file=out)
    times, elem = {}, 1 if args.fp8 else 2
    for shape, k, n in shapes:
        times.update(time_shape(shape, k, n, configs, args.fp8, args.reps, w4))
        for key in ("baseline", *configs):
            print(json.dumps({"kind": "time", "shape": shape, "K": k, "N": n, "fmt": "fp8" if args.fp8 else "bf16",
                              "op": key or "gemv_config", "us": round(times[shape, key], 2),
                              "GBps": round(elem * n * k / times[shape, key] / 1e3)}), file=out)
    cols = ["baseline", *configs]
    base = "FP8 tensor-core route" if args.fp8 else "cuBLAS bf16"
    print("\n| shape | " + " | ".join(f"{c or 'gemv_config'} us (GB/s)".replace("baseline", base) for c in cols)
          + " |")
    print("|---|" + "---|" * len(cols))
    for shape, k, n in shapes:
        print(f"| {shape} {k}->{n} | " + " | ".join(
            f"{times[shape, c]:.1f} ({elem * n * k / times[shape, c] / 1e3:.0f})" for c in cols) + " |")
    per_token = {c: LAYERS * sum(times[s, c] for s, _, _ in SHAPES[:4]) / 1e3
                 + (0 if args.fp8 else times["lm_head", c] / 1e3) for c in cols}
    print("| per token, ms | " + " | ".join(f"{per_token[c]:.3f}" for c in cols) + " |")
    print(f"checks failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
