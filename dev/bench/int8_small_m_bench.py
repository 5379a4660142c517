"""INT8 W8A8 (SmoothQuant) at 3 <= M <= 32 on the small-M GEMM's int8 form (lowbit.kernels.linear.fp8_small_m's
int8_small_m_gemm) on the GPU: checks, then times against the tensor-core int8 GEMM that w8a8 ran there before
(scaled_gemm) and cuBLAS bf16.

`python3 dev/bench/int8_small_m_bench.py [--m 9,16,24,32] [--configs "BN,BK,P,W,S;..."] [--reps N] [--json FILE]`:
1. checks int8_small_m_gemm (its default config and each --configs entry) against scaled_gemm_ref (fp32 math) on
   fresh random int8 operands: the four Llama-3.1-8B shapes at M = 3, 9, 16 and 32 with SmoothQuant's scales (one x
   scale, per-row weight scales), per-token x scales with bias, ragged K and N, and a CUDA graph replayed on new x
   (the split-K arrival counters must reset); rel err per x row, PASS below TOL; exit 1 if any check fails (timing
   still runs).
2. times per shape and M (SmoothQuant's scales): cuBLAS bf16, the int8 GEMM (scaled_gemm), the route
   (w8a8_linear_prequantized as configured), int8_small_m_gemm per config. Medians of CUDA-graph replays
   (dev/bench/kernels.py's time_us) over weight copies beyond L2.
Prints JSON lines and a markdown table of ms per token (the four linears x 32 layers).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit.bench_cli import int_list, json_lines  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import fp8_small_m as fsm  # noqa: E402

int8_bench = load_script("int8_gemv_bench.py")  # the checks and timing, run here on the small-M GEMM
gemv_bench = load_script("w4_gemv_bench.py")  # per_token_table
SMALL_M = (fsm.int8_small_m_gemm, "default", "small_m")  # int8_gemv_bench's target: kernel, config label, column


def run_checks(emit, configs) -> bool:
    cases = [(k, n, m, False, False) for _, k, n in int8_bench.SHAPES for m in (3, 9, 16, 32)]
    cases += [(4096, 4096, 24, True, True), (1040, 1030, 13, True, True), (14336, 130, 32, False, True),
              (4100, 18, 17, False, True)]
    ok = all([int8_bench.check(emit, c, case, SMALL_M) for c in configs for case in cases])
    # down (14336 -> 4096) splits its K over the SMs: the replays also check that each tile's counter resets
    return int8_bench.graph_check(emit, SMALL_M, m=16, k=14336, n=4096, replays=3) and ok


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
    rows = int8_bench.run_timing(emit, ms, configs, args.reps, SMALL_M)
    cols = ["cublas_bf16", "int8_gemm", "route"] + [str(c or "small_m") for c in configs]
    print("### INT8 (SmoothQuant scales), ms per token (four linears x 32 layers); int8_gemm = the route before")
    print(gemv_bench.per_token_table(rows, ms, cols))
    print(f"checks failed: {sum(d.get('result') == 'FAIL' for d in lines)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
