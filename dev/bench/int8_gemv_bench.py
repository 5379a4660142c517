"""INT8 W8A8 (SmoothQuant) at 1 <= M <= 8 by dp4a (lowbit.kernels.linear.int8_gemv) on the GPU: checks, then times against
the tensor-core int8 GEMM that w8a8_linear_prequantized ran before (scaled_gemm) and cuBLAS bf16.

`python3 dev/bench/int8_gemv_bench.py [--m 1,2,4,8] [--configs "BN,BK,W;..."] [--reps N] [--json FILE]` (repo root):
1. checks int8_gemv (its default CONFIG and each --configs entry) against scaled_gemm_ref (fp32 math) on fresh random
   int8 weights: the four Llama-3.1-8B shapes at M = 1, 3 and 8 with SmoothQuant's scales (one x scale,
   per-row weight scales), per-token x scales with bias, K not a multiple of BLOCK_K and N not a multiple of the
   tile, and a CUDA graph replayed on new x; rel err = ||out - ref|| / ||ref|| per x row, PASS below TOL; exit 1
   if any check fails (timing still runs).
2. times per shape and M (SmoothQuant's scales): cuBLAS bf16 (F.linear), the int8 GEMM (scaled_gemm, the route
   before), the route as configured (route), int8_gemv per config. Medians of CUDA-graph replays (dev/bench/kernels.py's
   time_us), weights in enough copies to stream from HBM.
Prints JSON lines and a markdown table of ms per token (the four linears x 32 layers).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit.bench_cli import gemv_configs, int_list, json_lines  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import int8_gemv, w8a8  # noqa: E402
from lowbit.kernels.linear.scaled_gemm import scaled_gemm, scaled_gemm_ref  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
TOL = 3e-3  # exact int32 sums against fp32 math; one bf16 rounding of the output (~2e-3 worst)
gemv_bench = load_script("w4_gemv_bench.py")  # rel_err, copies_for, per_token_table
time_us = load_script("kernels.py").time_us


def int8(shape):
    return torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)


def scales(m, n, per_token):
    """(scale_a, scale_b): SmoothQuant's one x scale (or one per x row) and per-row weight scales."""
    sa = torch.rand(m, 1, device="cuda") * 0.01 + 0.005 if per_token else torch.tensor(0.01, device="cuda")
    return sa, torch.rand(n, device="cuda") * 1e-3 + 5e-4


# the kernel under test: (function (q, w, sa, sb, bias, out_dtype, config), label of its default config, timing column)
GEMV = (int8_gemv.int8_gemv, tuning.current().int8_gemv_config, "chosen")


def check(emit, config, case, target=GEMV) -> bool:
    k, n, m, per_token, bias = case
    torch.manual_seed(k + n + m)
    q, w = int8((m, k)), int8((n, k))
    sa, sb = scales(m, n, per_token)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    out = target[0](q, w, sa, sb, b, torch.bfloat16, config)
    ref = scaled_gemm_ref(q, w, sa, sb, b, torch.float32)
    err = max(gemv_bench.rel_err(out[r], ref[r]) for r in range(m))
    ok = bool(torch.isfinite(out).all()) and err < TOL
    emit({"kind": "check", "config": config or target[1], "K": k, "N": n, "M": m,
          "per_token": per_token, "bias": bias, "rel_err": err, "tol": TOL, "result": "PASS" if ok else "FAIL"})
    return ok


def graph_check(emit, target=GEMV, m=4, k=4096, n=4096, replays=2) -> bool:
    """The kernel captured in a CUDA graph, replayed on new x (the engine's decode graphs)."""
    q, w = int8((m, k)), int8((n, k))
    sa, sb = scales(m, n, False)
    target[0](q, w, sa, sb, None, torch.bfloat16, None)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = target[0](q, w, sa, sb, None, torch.bfloat16, None)
    errs = []
    for _ in range(replays):
        q.copy_(int8((m, k)))
        out.fill_(float("nan"))
        g.replay()
        errs.append(gemv_bench.rel_err(out, scaled_gemm_ref(q, w, sa, sb, None, torch.float32)))
    emit({"kind": "check", "config": target[1], "M": m, "graph_replays": replays, "rel_err": max(errs),
          "tol": TOL, "result": "PASS" if max(errs) < TOL else "FAIL"})
    return max(errs) < TOL


def run_checks(emit, configs) -> bool:
    cases = [(k, n, m, False, False) for _, k, n in SHAPES for m in (1, 3, 8)]
    cases += [(4096, 4096, 5, True, True), (1040, 1030, 7, True, True), (14336, 130, 1, False, True),
              (4100, 18, 8, False, True)]
    ok = all([check(emit, c, case) for c in configs for case in cases])
    return graph_check(emit) and ok


def run_timing(emit, ms, configs, reps, target=GEMV) -> list:
    """Per shape and M: cuBLAS bf16, the int8 GEMM (scaled_gemm), the route, and the target kernel per config."""
    rows = []
    for name, k, n in SHAPES:
        ws = [int8((n, k)) for _ in range(gemv_bench.copies_for(n * k))]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(gemv_bench.copies_for(2 * n * k))]
        for m in ms:
            q, x = int8((m, k)), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sa, sb = scales(m, n, False)
            row = {"kind": "time", "shape": name, "M": m,
                   "cublas_bf16": time_us([lambda w=w: F.linear(x, w) for w in wb], reps),
                   "int8_gemm": time_us([lambda w=w: scaled_gemm(q, w, sa, sb) for w in ws], reps),
                   "route": time_us([lambda w=w: w8a8.w8a8_linear_prequantized(q, w, sb, sa, None, torch.bfloat16)
                                     for w in ws], reps)}
            for c in configs:
                row[str(c or target[2])] = time_us(
                    [lambda w=w, c=c: target[0](q, w, sa, sb, None, torch.bfloat16, c) for w in ws], reps)
            emit(row)
            rows.append(row)
        del ws, wb
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,2,4,8", help="rows of x, comma separated (at most 8)")
    ap.add_argument("--configs", default="", help="more int8_gemv configs, BN,BK,W;... (checked, then timed)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ms = int_list(ap, "--m", args.m)
    extra = gemv_configs(ap, "--configs", args.configs)
    if any(c[1] % (16 * 32 * c[2]) for c in extra):
        ap.error("--configs: BK a multiple of 512 x W")
    if any(not 1 <= m <= int8_gemv.MAX_M for m in ms):
        ap.error(f"--m: 1 to {int8_gemv.MAX_M}")
    if args.reps < 1:
        ap.error("--reps: at least 1")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = [None] + extra
    emit, lines = json_lines(args.json)
    ok = run_checks(emit, configs)
    rows = run_timing(emit, ms, configs, args.reps)
    cols = ["cublas_bf16", "int8_gemm", "route"] + [str(c or "chosen") for c in configs]
    print("### INT8 (SmoothQuant scales), ms per token (four linears x 32 layers); int8_gemm = the route before")
    print(gemv_bench.per_token_table(rows, ms, cols))
    print(f"checks failed: {sum(d.get('result') == 'FAIL' for d in lines)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
