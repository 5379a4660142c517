"""INT4 and NVFP4 at 1 <= M <= 16 on mma.sync (lowbit.kernels.linear.w4_mma) on the GPU: checks, then times against the
route w4a16_gemm takes (w4_mma in Tuning.w4_mma_rows; without it the GEMV at M <= 2, w4_small_m / the tensor-core kernel
above) and cuBLAS bf16.

`python3 dev/bench/w4_mma_bench.py [--m 1,2,4,8,16] [--configs "BN,BK,W;..."] [--reps N] [--json FILE]` (repo root):
1. checks w4_mma (its chosen config and each --configs entry) against w4a16_gemm_ref (fp32 math) on fresh random weights
   (INT4 group 128 and NVFP4): the four Llama-3.1-8B shapes at M = 1, 3, 8 and 16 (bf16), fp16 x, pre_quant_scale
   and bias, K not a multiple of BLOCK_K, N not a multiple of the tile, INT4 groups of 256, and a CUDA graph replayed
   on new x; rel err =
   ||out - ref|| / ||ref||, PASS below TOL; exit 1 if any check fails (timing still runs).
2. times per shape and M: cuBLAS bf16 (F.linear), w4a16_gemm as routed (route) and with w4_mma_rows off (no_mma),
   w4_mma per config (chosen: w4_mma.choose_config).
   Medians of CUDA-graph replays (dev/bench/kernels.py's time_us), weights in enough copies to stream from HBM.
Prints JSON lines and a markdown table per format and token (the four linears x 32 layers, ms).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit.bench_cli import gemv_configs, int_list  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import w4_mma, w4a16  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
TOL = 3e-3  # exact q x products and fp32 sums against fp32 math; one bf16 rounding of the output (~2e-3 worst)
gemv_bench = load_script("w4_gemv_bench.py")  # random_weight, rel_err, copies_for, weight_bytes, per_token_table
time_us = load_script("kernels.py").time_us


def check(emit, config, case) -> bool:
    fmt, k, n, m, group, dtype, smooth, bias = case
    torch.manual_seed(k + n + m)
    w = gemv_bench.random_weight(fmt, k, n, group, smooth, dev="cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    out = w4_mma.w4_mma(x, w, b, config)
    ref = w4a16.w4a16_gemm_ref(x, w, b)
    err = max(gemv_bench.rel_err(out[r], ref[r]) for r in range(m))  # the worst x row (each lane stores two)
    ok = bool(torch.isfinite(out).all()) and err < TOL
    emit({"kind": "check", "config": config or w4_mma.choose_config(m, n), "fmt": fmt, "K": k, "N": n, "M": m,
          "group": group, "dtype": str(dtype).removeprefix("torch."), "smooth": smooth, "bias": bias, "rel_err": err,
          "tol": TOL, "result": "PASS" if ok else "FAIL"})
    return ok


def run_checks(emit, configs) -> bool:
    cases = [(f, k, n, m, 128 if f == "int4" else 16, torch.bfloat16, False, False)
             for f in ("int4", "nvfp4") for _, k, n in SHAPES for m in (1, 3, 8, 16)]
    bf, fp = torch.bfloat16, torch.float16
    cases += [("int4", 4096, 4096, 5, 128, fp, True, True), ("int4", 1152, 1030, 8, 128, bf, True, True),
              ("int4", 4096, 4096, 13, 128, fp, True, True), ("int4", 1152, 1030, 11, 128, bf, True, True),
              ("int4", 14336, 130, 2, 256, bf, False, True), ("nvfp4", 2000, 1001, 5, 16, fp, True, True),
              ("nvfp4", 1152, 1030, 11, 16, bf, True, True)]
    ok = all([check(emit, c, case) for c in configs for case in cases])
    w = gemv_bench.random_weight("nvfp4", 4096, 4096, dev="cuda")
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w4_mma.w4_mma(x, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w4_mma.w4_mma(x, w)
    errs = []
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        errs.append(gemv_bench.rel_err(out, w4a16.w4a16_gemm_ref(x, w)))
    emit({"kind": "check", "config": w4_mma.choose_config(16, 4096), "fmt": "nvfp4", "M": 16, "graph_replays": 2,
          "rel_err": max(errs), "tol": TOL, "result": "PASS" if max(errs) < TOL else "FAIL"})
    return ok and max(errs) < TOL


def without_mma(x, w):
    """w4a16_gemm as routed with w4_mma switched off."""
    with tuning.override(w4_mma_rows={}):
        return w4a16.w4a16_gemm(x, w)


def run_timing(emit, ms, configs, reps) -> list:
    rows = []
    for (name, k, n), fmt in [(shape, f) for shape in SHAPES for f in ("int4", "nvfp4")]:
        ws = [gemv_bench.random_weight(fmt, k, n, dev="cuda")
              for _ in range(gemv_bench.copies_for(gemv_bench.weight_bytes(fmt, k, n)))]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(gemv_bench.copies_for(2 * n * k))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"kind": "time", "fmt": fmt, "shape": name, "M": m,
                   "cublas_bf16": time_us([lambda w=w: F.linear(x, w) for w in wb], reps),
                   "route": time_us([lambda w=w: w4a16.w4a16_gemm(x, w) for w in ws], reps),
                   "no_mma": time_us([lambda w=w: without_mma(x, w) for w in ws], reps)}
            for c in configs:
                calls = [lambda w=w, c=c: w4_mma.w4_mma(x, w, config=c) for w in ws]
                row[str(c or "chosen")] = time_us(calls, reps)
            emit(row)
            rows.append(row)
        del ws, wb
        torch.cuda.empty_cache()
    return rows


def table(rows, ms, configs) -> str:
    cols = ["cublas_bf16", "route", "no_mma"] + [str(c or "chosen") for c in configs]
    return "\n\n".join(f"{fmt}:\n" + gemv_bench.per_token_table([r for r in rows if r["fmt"] == fmt], ms, cols)
                       for fmt in ("int4", "nvfp4"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,2,4,8,16", help="rows of x, comma separated (at most 16)")
    ap.add_argument("--configs", default="", help="more w4_mma configs, BN,BK,W;... (checked, then timed)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ms = int_list(ap, "--m", args.m)
    extra = gemv_configs(ap, "--configs", args.configs)
    if any(c[0] % 16 or c[1] % (128 * c[2]) for c in extra):
        ap.error("--configs: BN a multiple of 16, BK a multiple of 128 x W")
    if any(not 1 <= m <= w4_mma.MAX_M for m in ms):
        ap.error(f"--m: 1 to {w4_mma.MAX_M}")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = [None] + extra
    lines = []

    def emit(d):
        lines.append(d)
        print(json.dumps(d), flush=True)

    ok = run_checks(emit, configs)
    rows = run_timing(emit, ms, configs, args.reps)
    print("### INT4 g128 and NVFP4, ms per token (four linears x 32 layers); "
          "route = w4a16_gemm, no_mma = without w4_mma")
    print(table(rows, ms, configs))
    print(f"checks failed: {sum(d.get('result') == 'FAIL' for d in lines)}")
    if args.json:
        args.json.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
