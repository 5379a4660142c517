"""W4A16 at large M on the GPU: the dequantize-then-cuBLAS path (lowbit.kernels.linear.w4_dequant) against the tensor-core
kernel (w4a16.tensor_core_gemm) and cuBLAS bf16, to place w4a16.DEQUANT_MIN_M.

`python3 dev/bench/w4_large_m_bench.py [--m 64,128,256,512,1024,4096] [--reps N] [--json FILE]` (from the repo root):
1. checks both paths against w4a16_gemm_ref (fp32 math) on fresh random weights (INT4 group 128, NVFP4) at the four
   Llama-3.1-8B shapes, M = 256, bf16 x, with pre_quant_scale and bias on one shape; also a CUDA graph replayed on
   new x; rel err = ||out - ref|| / ||ref||, PASS below TOL; exit 1 if any check fails (timing still runs).
2. times, per shape, format and M: cuBLAS bf16 (F.linear on a bf16 weight), the tensor-core kernel, the dequant path,
   and the dequantization alone (GB/s = 4-bit bytes read + 16-bit bytes written). Medians of CUDA-graph replays
   (dev/bench/kernels.py's time_us), weights in several copies so that calls stream them from HBM.
Prints JSON lines and a markdown table of us per call and per token-row of Llama-3.1-8B (x32 layers).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit.bench_cli import int_list, json_lines  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import w4_dequant, w4a16  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
TOL = 3e-3  # bf16 weights (dequant path) or bf16 tiles (tensor-core kernel) against fp32 math: measured ~1e-3
L2_BYTES = 60 * 2**20
gemv_bench = load_script("w4_gemv_bench.py")  # random_weight, rel_err, weight_bytes, per_token_table
time_us = load_script("kernels.py").time_us


def run_checks(emit) -> bool:
    ok_all = True
    paths = {"tensor_core": lambda x, w, b: w4a16.tensor_core_gemm(x, w, b),
             "dequant": lambda x, w, b: w4_dequant.dequant_linear(x, w, b)}
    for name, k, n in SHAPES:
        for fmt in ("int4", "nvfp4"):
            extra = name == "o"  # pre_quant_scale and bias on one shape
            w = gemv_bench.random_weight(fmt, k, n, smooth=extra, dev="cuda")
            x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if extra else None
            ref = w4a16.w4a16_gemm_ref(x, w, b)
            for path, fn in paths.items():
                err = gemv_bench.rel_err(fn(x, w, b), ref)
                ok = err < TOL
                ok_all &= ok
                emit({"kind": "check", "path": path, "fmt": fmt, "shape": name, "M": 256, "smooth": extra,
                      "bias": extra, "rel_err": err, "tol": TOL, "result": "PASS" if ok else "FAIL"})
    w = gemv_bench.random_weight("int4", 4096, 4096, dev="cuda")
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w4a16.w4a16_gemm(x, w)  # the scratch grows outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w4a16.w4a16_gemm(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    err = gemv_bench.rel_err(out, w4a16.w4a16_gemm_ref(x, w))
    ok_all &= err < TOL
    emit({"kind": "check", "path": "w4a16_gemm graph replay", "fmt": "int4", "M": 512, "rel_err": err, "tol": TOL,
          "result": "PASS" if err < TOL else "FAIL"})
    return ok_all


def time_shape(name, k, n, ms, reps, emit):
    rows = []
    bf16_bytes = 2 * n * k
    copies = max(1, min(16, -(-4 * L2_BYTES // (n * k // 2))))
    ws = {fmt: [gemv_bench.random_weight(fmt, k, n, dev="cuda") for _ in range(copies)] for fmt in ("int4", "nvfp4")}
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(1, copies // 4))]
    scratch = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    for fmt in ("int4", "nvfp4"):
        us = time_us([lambda w=w: w4_dequant.dequantize_into(w, scratch) for w in ws[fmt]], reps)
        gbs = (gemv_bench.weight_bytes(fmt, k, n) + bf16_bytes) / us / 1e3
        emit({"kind": "dequant", "shape": name, "fmt": fmt, "us": us, "GB_s": round(gbs)})
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"kind": "time", "shape": name, "M": m, "bf16": time_us([lambda w=w: F.linear(x, w) for w in wb], reps)}
        for fmt in ("int4", "nvfp4"):
            row[f"{fmt}_tensor_core"] = time_us([lambda w=w: w4a16.tensor_core_gemm(x, w) for w in ws[fmt]], reps)
            row[f"{fmt}_dequant"] = time_us([lambda w=w: w4_dequant.dequant_linear(x, w) for w in ws[fmt]], reps)
        emit(row)
        rows.append(row)
    return rows


def table(rows, ms) -> str:
    cols = ["bf16", "int4_tensor_core", "int4_dequant", "nvfp4_tensor_core", "nvfp4_dequant"]
    return gemv_bench.per_token_table(rows, ms, cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="64,128,256,512,1024,4096", help="rows of x, comma separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    ms = int_list(ap, "--m", args.m)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    emit, lines = json_lines()
    ok = run_checks(emit)
    rows = []
    for name, k, n in SHAPES:
        rows += time_shape(name, k, n, ms, args.reps, emit)
    print("### us per call summed over qkv, o, gate_up, down, x32 layers (ms)\n" + table(rows, ms))
    if args.json:
        args.json.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    print(f"checks failed: {sum(d.get('result') == 'FAIL' for d in lines)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
