"""W4A16 at M = 17-512 on the GPU: the tensor-core kernel (w4a16._w4_gemm_kernel) as w4a16_gemm routes it, against
the dequantize-then-cuBLAS path (w4_dequant), cuBLAS bf16 and, with --sweep, the kernel's best tile config, to place
w4a16.DEQUANT_MIN_M and the TUNED configs.

`python3 dev/bench/w4_mid_m_bench.py [--m 32,64,128,256] [--sweep 32,64] [--reps N] [--json FILE]` (from the repo root):
1. checks the kernel at its default config and at 64 x 128 / 64 x 256 tiles against w4a16_gemm_ref (fp32 math) on
   fresh random weights at the four Llama-3.1-8B shapes, M = 64 and 48 (a partial M tile): INT4 group 128 and
   NVFP4 with bf16 x, pre_quant_scale and bias on one shape; INT4 group 64 and fp16 x on another; rel err =
   ||out - ref|| / ||ref||, PASS below TOL; exit 1 if any check fails (timing still runs).
2. times, per M, shape and format: cuBLAS bf16, the route, the tensor-core kernel at choose_config's pick, the
   dequant path, and at the --sweep Ms the kernel over tile configs. Medians of CUDA-graph replays (dev/bench/kernels.py's
   time_us), weights in several copies so that calls stream them from HBM.
Prints JSON lines, and per format a markdown table of ms per token of Llama-3.1-8B (the four linears x 32 layers).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit.bench_cli import int_list, json_lines  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import w4_dequant, w4a16  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
TOL = 3e-3  # 16-bit tiles against fp32 math: measured ~1e-4 (benchmarks.md run 47)
L2_BYTES = 60 * 2**20
LAYERS = 32
FORMATS = ("int4", "nvfp4")
gemv_bench = load_script("w4_gemv_bench.py")  # random_weight, rel_err, per_token_table
time_us = load_script("kernels.py").time_us


def configs(m, k, n):
    """(BLOCK_M, BLOCK_N, split, warps, stages) to sweep at M rows: choose_config's plus 64- to 256-row tiles."""
    tiles = k // 128
    bms = [min(64, max(16, 1 << (m - 1).bit_length()))] + ([128] if m >= 128 else [])
    out = [w4a16.choose_config(m, n, k)]
    for bm in bms:
        for bn, warps in ((64, 4), (128, 8), (256, 8)):
            programs = -(-n // bn) * -(-m // bm)
            for split in (1, 2, 4, 8):
                if tiles // split >= 4 and (split == 1 or programs * split <= 1056) and bm * bn < 128 * 256:  # spills
                    for stages in (3, 4) if bn < 256 else (2, 3):
                        out.append((bm, bn, split, warps, stages))
    return list(dict.fromkeys(out))


def check_cases():
    """(fmt, shape, group, x dtype, smooth and bias)."""
    cases = [(fmt, shape, 128, torch.bfloat16, shape[0] == "o") for shape in SHAPES for fmt in FORMATS]
    return cases + [("int4", SHAPES[0], 64, torch.bfloat16, False), ("int4", SHAPES[3], 128, torch.float16, True)]


def run_checks(emit) -> bool:
    ok_all = True
    for fmt, (name, k, n), group, dtype, extra in check_cases():
        w = gemv_bench.random_weight(fmt, k, n, group=group, smooth=extra, dev="cuda")
        b = torch.randn(n, device="cuda", dtype=dtype) if extra else None
        for m in (64, 48):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = w4a16.w4a16_gemm_ref(x, w, b)
            for config in (None, (64, 256, 1, 8, 3), (64, 128, 2, 8, 3)):
                err = gemv_bench.rel_err(w4a16.tensor_core_gemm(x, w, b, config), ref)
                ok = err < TOL
                ok_all &= ok
                emit({"kind": "check", "config": config, "fmt": fmt, "shape": name, "group": group,
                      "dtype": str(dtype)[6:], "M": m, "smooth_bias": extra, "rel_err": err, "tol": TOL,
                      "result": "PASS" if ok else "FAIL"})
    return ok_all


def weights(k, n):
    """Copies enough to stream from HBM: {fmt: [W4Weight]}, and bf16 weights."""
    copies = max(1, min(16, -(-4 * L2_BYTES // (n * k // 2))))
    ws = {fmt: [gemv_bench.random_weight(fmt, k, n, dev="cuda") for _ in range(copies)] for fmt in FORMATS}
    return ws, [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(1, copies // 4))]


def time_m(m, sweep, reps, emit):
    """One row per shape at M rows."""
    rows = []
    for name, k, n in SHAPES:
        ws, wb = weights(k, n)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"kind": "time", "shape": name, "M": m, "bf16": time_us([lambda w=w: F.linear(x, w) for w in wb], reps)}
        for fmt in FORMATS:
            row[f"{fmt}_route"] = time_us([lambda w=w: w4a16.w4a16_gemm(x, w) for w in ws[fmt]], reps)
            row[f"{fmt}_kernel"] = time_us([lambda w=w: w4a16.tensor_core_gemm(x, w) for w in ws[fmt]], reps)
            row[f"{fmt}_dequant"] = time_us([lambda w=w: w4_dequant.dequant_linear(x, w) for w in ws[fmt]], reps)
            if sweep:
                best = (float("inf"), None)
                for cfg in configs(m, k, n):
                    us = time_us([lambda w=w: w4a16.tensor_core_gemm(x, w, config=cfg) for w in ws[fmt]], reps)
                    emit({"kind": "config", "shape": name, "M": m, "fmt": fmt, "config": cfg, "us": us})
                    best = min(best, (us, cfg))
                row[f"{fmt}_best"], row[f"{fmt}_best_config"] = best
        emit(row)
        rows.append(row)
        del ws, wb
    return rows


def tables(rows, ms) -> str:
    out = []
    for fmt in FORMATS:
        cols = ["bf16", f"{fmt}_route", f"{fmt}_kernel", f"{fmt}_dequant"]
        swept = [m for m in ms if all(f"{fmt}_best" in r for r in rows if r["M"] == m)]
        out.append(f"### {fmt}: ms per token (qkv + o + gate_up + down) x {LAYERS} layers")
        out.append(gemv_bench.per_token_table(rows, ms, cols))
        if swept:
            out.append(gemv_bench.per_token_table(rows, swept, [f"{fmt}_best"]))
            out.append("best configs: " + "; ".join(f"{r['shape']} M={r['M']} {r[f'{fmt}_best_config']}"
                                                    for r in rows if r["M"] in swept))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="32,64,128,256", help="rows of x, comma separated")
    ap.add_argument("--sweep", default="", help="Ms (of --m) at which to sweep tile configs, comma separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ms = int_list(ap, "--m", args.m)
    sweep = set(int_list(ap, "--sweep", args.sweep)) if args.sweep else set()
    if not sweep <= set(ms):
        ap.error(f"--sweep {args.sweep}: every M swept must be one of --m {args.m}")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be at least 1")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    emit, lines = json_lines(args.json)  # JSON lines written as they come: a run cut short keeps what it measured
    ok = run_checks(emit)
    rows = []
    for m in ms:  # M outer: a run cut short has every shape of the Ms it reached
        rows += time_m(m, m in sweep, args.reps, emit)
        print(tables(rows, [r["M"] for r in rows if r["shape"] == SHAPES[0][0]]), flush=True)
    print(f"checks failed: {sum(d.get('result') == 'FAIL' for d in lines)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
