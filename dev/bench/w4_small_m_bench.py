"""W4A16 at small batch (lowbit.kernels.linear.w4_small_m, 2 <= M <= 16) on the GPU: checks, a config sweep, then times.

`python3 dev/bench/w4_small_m_bench.py [--json FILE] [--budget-s S] [--no-sweep]` (repo root; ~3 min on an H200):
1. checks w4_small_m against w4a16_gemm_ref (fp32 math) on fresh random inputs: INT4 groups 128 / 32 / 16, NVFP4,
   bf16 and fp16 x, pre_quant_scale and bias, ragged K and odd N, M in {2, 5, 16}, with and without K splits;
   rel err < TOL (both rounded to x's dtype); exit 1 if any check fails.
2. sweeps (BLOCK_N, split, num_warps, num_stages, BLOCK_M) at M = 16 on the Llama-3.1-8B shapes, both formats.
3. times the best config per shape at M in {2, 4, 8, 16} against the tensor-core kernel w4a16_gemm runs today and
   cuBLAS bf16 (F.linear) at the same M. Timing as dev/bench/w4_gemv_bench.py (CUDA-graph medians, weights from HBM).
JSON lines, then a markdown table.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import w4_small_m, w4a16  # noqa: E402

gemv_bench = load_script("w4_gemv_bench.py")
SHAPES = gemv_bench.SHAPES
TOL = 4e-3  # bf16 planes dequantized per word (groups < 128) round each weight once: ~1e-3 measured on the CPU
M_TIMED = (2, 4, 8, 16)
# (BLOCK_N, split, num_warps, num_stages, BLOCK_M). 8 warps take BLOCK_M 32: at 16 the x planes (512 bytes) leave
# under 4 bytes per thread, and Triton loads them synchronously (run 38's 8-warp configs lost)
SWEEP = [(bn, split, warps, stages, bm) for (bn, warps, bm), split, stages in
         itertools.product([(64, 4, 16), (128, 4, 16), (128, 8, 32), (256, 8, 32)], [1, 2, 4, 8, 16], [2, 3, 4])]


def check_cases():
    """(fmt, K, N, group, x dtype, smooth, bias, M, config or None for choose_config)."""
    cases = []
    for (_, k, n), m in itertools.product(SHAPES, (2, 16)):
        cases += [("int4", k, n, 128, torch.bfloat16, False, False, m, None),
                  ("nvfp4", k, n, 16, torch.bfloat16, False, False, m, None)]
    cases += [("int4", 1152, 1030, 128, torch.bfloat16, True, True, 5, (64, 1, 4, 3)),
              ("int4", 1152, 1030, 128, torch.bfloat16, True, True, 5, (64, 4, 4, 3)),
              ("nvfp4", 2000, 1001, 16, torch.bfloat16, True, True, 16, (64, 2, 4, 3)),
              ("int4", 4096 + 416, 102, 32, torch.float16, True, True, 3, (64, 2, 4, 3)),
              ("int4", 3088, 66, 16, torch.bfloat16, False, True, 16, (64, 1, 4, 3)),
              ("nvfp4", 14336, 130, 16, torch.float16, True, False, 7, (64, 8, 4, 3)),
              ("int4", 4096, 28672, 128, torch.bfloat16, False, False, 9, (128, 4, 8, 3, 32)),
              ("nvfp4", 4096, 6144, 16, torch.bfloat16, False, True, 16, (256, 8, 8, 3, 32))]
    return cases


def run_checks(emit) -> bool:
    ok_all = True
    for fmt, k, n, group, dtype, smooth, bias, m, config in check_cases():
        torch.manual_seed(k * 7 + n + m)
        w = gemv_bench.random_weight(fmt, k, n, group, smooth)
        x = torch.randn(m, k, device="cuda").to(dtype)
        b = torch.randn(n, device="cuda").to(dtype) if bias else None
        out = w4_small_m.w4_small_m(x, w, b, config)
        err = gemv_bench.rel_err(out, w4a16.w4a16_gemm_ref(x, w, b))
        ok = bool(torch.isfinite(out).all()) and err < TOL
        ok_all &= ok
        emit({"kind": "check", "fmt": fmt, "group": group, "K": k, "N": n, "M": m, "config": config,
              "dtype": str(dtype).removeprefix("torch."), "smooth": smooth, "bias": bias, "rel_err": err,
              "tol": TOL, "result": "PASS" if ok else "FAIL"})
    return ok_all


def weights(fmt, k, n):
    copies = gemv_bench.copies_for(gemv_bench.weight_bytes(fmt, k, n))
    return [gemv_bench.random_weight(fmt, k, n) for _ in range(copies)]


def time_op(op, x, ws, reps=15) -> float:
    return gemv_bench.graph_time_us([lambda w=w: op(x, w) for w in ws], reps)


def sweep(emit, deadline) -> dict:
    """(fmt, shape) -> the fastest config at M = 16."""
    best = {}
    for (shape, k, n), fmt in itertools.product(SHAPES, ("int4", "nvfp4")):
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        ws = weights(fmt, k, n)
        tiles = -(-k // 128)
        for cfg in SWEEP:
            if time.time() > deadline:
                break
            if tiles // cfg[1] < 2:
                continue
            us = time_op(lambda x, w, cfg=cfg: w4_small_m.w4_small_m(x, w, config=cfg), x, ws)
            emit({"kind": "sweep", "shape": shape, "fmt": fmt, "M": 16, "config": cfg, "us": us})
            if (fmt, shape) not in best or us < best[fmt, shape][1]:
                best[fmt, shape] = (cfg, us)
        del ws
        torch.cuda.empty_cache()
    return {key: cfg for key, (cfg, _) in best.items()}


def run_timing(emit, best) -> list:
    rows = []
    for shape, k, n in SHAPES:
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                for _ in range(gemv_bench.copies_for(2 * n * k))]
        for m in M_TIMED:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_op(F.linear, x, bf16)
            row = {"kind": "time", "shape": shape, "K": k, "N": n, "M": m, "cublas_bf16_us": cublas}
            rows.append(row)
            for fmt in ("int4", "nvfp4"):
                ws = weights(fmt, k, n)
                cfg = best.get((fmt, shape))
                new = time_op(lambda x, w: w4_small_m.w4_small_m(x, w, config=cfg), x, ws)
                old = time_op(lambda x, w: w4a16.w4a16_gemm(x, w, config=w4a16.choose_config(m, n, k, fmt)), x, ws)
                row[fmt] = {"config": cfg, "small_m_us": new, "tensor_core_us": old,
                            "GBps": gemv_bench.weight_bytes(fmt, k, n) / new / 1e3, "x_cublas": cublas / new,
                            "tensor_core_x_cublas": cublas / old}
                del ws
            emit(row)
        del bf16
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    out = ["| shape | M | cuBLAS bf16 us | INT4 small-M us (GB/s) | x cuBLAS | tensor-core x cuBLAS "
           "| NVFP4 small-M us (GB/s) | x cuBLAS | tensor-core x cuBLAS |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['shape']} {r['K']}->{r['N']}", str(r["M"]), f"{r['cublas_bf16_us']:.1f}"]
        for fmt in ("int4", "nvfp4"):
            f = r[fmt]
            cells += [f"{f['small_m_us']:.1f} ({f['GBps']:.0f})", f"{f['x_cublas']:.2f}x",
                      f"{f['tensor_core_x_cublas']:.2f}x"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--budget-s", type=float, default=200, help="stop the sweep after this many seconds")
    ap.add_argument("--no-sweep", action="store_true", help="time choose_config's picks only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: w4_small_m_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    lines = []

    def emit(d):
        lines.append(d)
        print(json.dumps(d, default=str), flush=True)

    t0 = time.time()
    emit({"kind": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "triton": __import__("triton").__version__})
    ok = run_checks(emit)
    emit({"kind": "checks_done", "all_pass": ok, "s": round(time.time() - t0, 1)})
    best = {} if args.no_sweep else sweep(emit, t0 + args.budget_s)
    emit({"kind": "best", "configs": {f"{f}/{s}": c for (f, s), c in best.items()}})
    rows = run_timing(emit, best)
    print(table(rows))
    if args.json:
        args.json.write_text("\n".join(json.dumps(d, default=str) for d in lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
