"""INT8 W8A8 (SmoothQuant) at 3 <= M <= 32 on the small-M GEMM's int8 form (lowbit.kernels.fp8_small_m's
int8_small_m_gemm) on the GPU: checks, then times against the tensor-core int8 GEMM that w8a8 ran there before
(scaled_gemm) and cuBLAS bf16.

`python3 bench/int8_small_m_bench.py [--m 9,16,24,32] [--configs "BN,BK,P,W,S;..."] [--reps N] [--json FILE]`:
1. checks int8_small_m_gemm (its default config and each --configs entry) against scaled_gemm_ref (fp32 math) on
   fresh random int8 operands: the four Llama-3.1-8B shapes at M = 3, 9, 16 and 32 with SmoothQuant's scales (one x
   scale, per-row weight scales), per-token x scales with bias, ragged K and N, and a CUDA graph replayed on new x
   (the split-K arrival counters must reset); rel err per x row, PASS below TOL; exit 1 if any check fails (timing
   still runs).
2. times per shape and M (SmoothQuant's scales): cuBLAS bf16, the int8 GEMM (scaled_gemm), the route
   (w8a8_linear_prequantized as configured), int8_small_m_gemm per config. Medians of CUDA-graph replays
   (bench/kernels.py's time_us) over weight copies beyond L2.
Prints JSON lines and a markdown table of ms per token (the four linears x 32 layers).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without pip install -e

from lowbit.bench_cli import int_list, json_lines, load_script  # noqa: E402
from lowbit.kernels import fp8_small_m as fsm, w8a8  # noqa: E402
from lowbit.kernels.scaled_gemm import scaled_gemm, scaled_gemm_ref  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
TOL = 3e-3  # exact int32 sums per program, fp32 partials and scales; one bf16 rounding of the output (~2e-3 worst)
gemv_bench = load_script("w4_gemv_bench.py")  # rel_err, copies_for, per_token_table
int8_bench = load_script("int8_gemv_bench.py")  # int8, scales
time_us = load_script("kernels.py").time_us


def check(emit, config, case) -> bool:
    k, n, m, per_token, bias = case
    torch.manual_seed(k + n + m)
    q, w = int8_bench.int8((m, k)), int8_bench.int8((n, k))
    sa, sb = int8_bench.scales(m, n, per_token)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    out = fsm.int8_small_m_gemm(q, w, sa, sb, b, torch.bfloat16, config)
    ref = scaled_gemm_ref(q, w, sa, sb, b, torch.float32)
    err = max(gemv_bench.rel_err(out[r], ref[r]) for r in range(m))
    ok = bool(torch.isfinite(out).all()) and err < TOL
    emit({"kind": "check", "config": config or "default", "K": k, "N": n, "M": m, "per_token": per_token,
          "bias": bias, "rel_err": err, "tol": TOL, "result": "PASS" if ok else "FAIL"})
    return ok


def graph_check(emit) -> bool:
    """Captured in a CUDA graph and replayed on new x: down (14336 -> 4096) splits its K over the SMs, so the
    replays also check that the last part of each tile resets its arrival counter."""
    q, w = int8_bench.int8((16, 14336)), int8_bench.int8((4096, 14336))
    sa, sb = int8_bench.scales(16, 4096, False)
    fsm.int8_small_m_gemm(q, w, sa, sb)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fsm.int8_small_m_gemm(q, w, sa, sb)
    errs = []
    for _ in range(3):
        q.copy_(int8_bench.int8((16, 14336)))
        out.fill_(float("nan"))
        g.replay()
        errs.append(gemv_bench.rel_err(out, scaled_gemm_ref(q, w, sa, sb, None, torch.float32)))
    ok = max(errs) < TOL
    emit({"kind": "check", "config": "default", "M": 16, "graph_replays": 3, "rel_err": max(errs), "tol": TOL,
          "result": "PASS" if ok else "FAIL"})
    return ok


def run_checks(emit, configs) -> bool:
    cases = [(k, n, m, False, False) for _, k, n in SHAPES for m in (3, 9, 16, 32)]
    cases += [(4096, 4096, 24, True, True), (1040, 1030, 13, True, True), (14336, 130, 32, False, True),
              (4100, 18, 17, False, True)]
    ok = all([check(emit, c, case) for c in configs for case in cases])
    return graph_check(emit) and ok


def run_timing(emit, ms, configs, reps) -> list:
    rows = []
    for name, k, n in SHAPES:
        ws = [int8_bench.int8((n, k)) for _ in range(gemv_bench.copies_for(n * k))]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(gemv_bench.copies_for(2 * n * k))]
        for m in ms:
            q, x = int8_bench.int8((m, k)), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sa, sb = int8_bench.scales(m, n, False)
            row = {"kind": "time", "shape": name, "M": m,
                   "cublas_bf16": time_us([lambda w=w: F.linear(x, w) for w in wb], reps),
                   "int8_gemm": time_us([lambda w=w: scaled_gemm(q, w, sa, sb) for w in ws], reps),
                   "route": time_us([lambda w=w: w8a8.w8a8_linear_prequantized(q, w, sb, sa, None, torch.bfloat16)
                                     for w in ws], reps)}
            for c in configs:
                row[str(c or "small_m")] = time_us([lambda w=w, c=c: fsm.int8_small_m_gemm(q, w, sa, sb, config=c)
                                                    for w in ws], reps)
            emit(row)
            rows.append(row)
        del ws, wb
        torch.cuda.empty_cache()
    return rows


def parse_configs(ap, text: str) -> list:
    """'BN,BK,P,W,S;...' -> [(BN, BK, P, W, S), ...]: PROGRAMS P >= 0 (0: one program per N tile), the rest > 0."""
    try:
        out = [tuple(int(v) for v in item.split(",")) for item in text.split(";") if item.strip()]
    except ValueError:
        out = None
    if out is None or any(len(c) != 5 or c[2] < 0 or min(c[:2] + c[3:]) <= 0 for c in out):
        ap.error(f"--configs: BN,BK,P,W,S[;BN,BK,P,W,S...], got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="9,16,24,32", help=f"rows of x, comma separated (at most {fsm.MAX_M})")
    ap.add_argument("--configs", default="", help="more configs BN,BK,PROGRAMS,W,STAGES;... (checked, then timed)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ms = int_list(ap, "--m", args.m)
    configs = [None] + parse_configs(ap, args.configs)
    if any(m > fsm.MAX_M for m in ms):
        ap.error(f"--m: 1 to {fsm.MAX_M}")
    if args.reps < 1:
        ap.error("--reps: at least 1")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    emit, lines = json_lines(args.json)
    ok = run_checks(emit, configs)
    rows = run_timing(emit, ms, configs, args.reps)
    cols = ["cublas_bf16", "int8_gemm", "route"] + [str(c or "small_m") for c in configs]
    print("### INT8 (SmoothQuant scales), ms per token (four linears x 32 layers); int8_gemm = the route before")
    print(gemv_bench.per_token_table(rows, ms, cols))
    print(f"checks failed: {sum(d.get('result') == 'FAIL' for d in lines)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
