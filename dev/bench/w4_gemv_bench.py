"""W4A16 decode GEMV (lowbit.kernels.linear.w4_gemv, M = 1) on the GPU: correctness, then time vs cuBLAS bf16.

`python3 dev/bench/w4_gemv_bench.py [--smooth] [--m2] [--json FILE] [--reps N] [--no-checks] [--configs "BN,BK,W;..."]`
(from the repo root; ~30-60 s on an H200 per config, mostly Triton compiles; `--dry-run`: CPU smoke test of the
script under the interpreter, tiny shapes). --m2: x of two rows (GEMV_CONFIG_M2 per format), also timed against
the route without the GEMV (w4a16.tensor_core_gemm: w4_small_m / the tensor-core kernel). --configs: other GEMV
configs (the fields of w4_gemv.GEMV_CONFIG's values), each checked and timed after the default:
1. checks the GEMV (w4_gemv.GEMV_CONFIG per format) against the torch reference w4a16_gemm_ref (fp32 math) on fresh
   random inputs on the GPU: INT4 (group 128, plus 16/32 on ragged shapes) and NVFP4, the four Llama-3.1-8B shapes,
   ragged K (padded to 128, not a multiple of BLOCK_K) and odd N with pre_quant_scale and bias, bf16 and fp16 x, and
   CUDA graph replays on new x; rel err = ||out - ref|| / ||ref|| (both rounded to x's dtype), PASS below TOL; exit 1 if
   any check fails (timing still runs).
2. times it at M = 1 on qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096 for INT4 (group 128)
   and NVFP4, plus cuBLAS bf16 (F.linear) as a reference. Times are medians over REPS replays of a CUDA graph that
   calls the op once per weight copy, with enough copies (>= 20 calls, > 4x L2 of weights) that every call streams
   its weights from HBM; so launch overhead is amortized as in the engine's graphs.
   GB/s = (weight + scale bytes) / time.
Prints JSON lines (one per check and per timing) and a final markdown table; --json writes them all to a file.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

DRY_RUN = "--dry-run" in sys.argv  # CPU smoke test of this script under the Triton interpreter (tiny shapes)
if DRY_RUN:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit.bench_cli import gemv_configs  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.linear import w4_gemv, w4a16  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402

DEV = "cpu" if DRY_RUN else "cuda"
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
if DRY_RUN:
    SHAPES = [("qkv", 2048, 24), ("o", 2048, 16), ("gate_up", 2048, 40), ("down", 3072, 16)]
LAYERS = 32  # Llama-3.1-8B: per-token figures = 32 x the four shapes
L2_BYTES = 60 * 2**20
MIN_CALLS = 20
TOL = 2e-3  # both sides rounded to bf16/fp16: only rounding flips differ (measured ~1e-4 or less)
if DRY_RUN:
    TOL = 1e-2  # the interpreter truncates fp32 -> bf16 (~4e-3), the GPU rounds


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def random_weight(fmt, k, n, group=128, smooth=False, dev=None):
    """A W4Weight with random nibbles (every code valid) and scales at real scale ranges; padding as pack_* does."""
    dev = dev or DEV
    kp = -(-k // 128) * 128
    qweight = torch.randint(-2**31, 2**31 - 1, (n, kp // 8), device=dev, dtype=torch.int32)
    sm = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16) if smooth else None
    if fmt == "int4":
        scales = torch.rand(-(-kp // group), n, device=dev) * 1e-2 + 1e-3
        return w4a16.W4Weight("int4", qweight, scales, n, k, group, 1.0, sm)
    scales = (torch.rand(kp // 128, n, 8, device=dev) * 400 + 1).to(torch.float8_e4m3fn)
    return w4a16.W4Weight("nvfp4", qweight, scales, n, k, 16, 1e-4, sm)


def weight_bytes(fmt, k, n) -> int:
    return n * k // 2 + (4 * n * k // 128 if fmt == "int4" else n * k // 16)


def gemv(x, w, bias=None, config=None):
    return w4_gemv.w4_gemv(x, w, bias, config)


# ---- checks
def check_cases():
    """(fmt, K, N, group, x dtype, smooth, bias)."""
    cases = []
    for _, k, n in SHAPES:
        cases += [("int4", k, n, 128, torch.bfloat16, False, False), ("nvfp4", k, n, 16, torch.bfloat16, False, False)]
    cases += [
        ("int4", 1152, 1030, 128, torch.bfloat16, True, True),  # K = 9 x 128: ragged last step
        ("nvfp4", 2000, 1001, 16, torch.bfloat16, True, True),  # K padded to 2048, odd N
        ("int4", 4096 + 416, 102, 32, torch.float16, True, True),
        ("int4", 3088, 66, 16, torch.bfloat16, False, True),  # groups of 16: two scales per chunk
        ("nvfp4", 14336, 130, 16, torch.float16, True, False),
    ]
    if DRY_RUN:
        cases = [(f, k, min(n, 18) + n % 2, g, d, sm, b) for f, k, n, g, d, sm, b in cases if k < 5000]
    return cases


def default_config(m: int, fmt: str):
    t = tuning.current()
    return (t.w4_gemv_config if m == 1 else t.w4_gemv_config_m2)[fmt]


def config_key(config):
    """How rows name a config: "default" (None: each format's default for m rows), "tensor_core", or a tuple."""
    return "default" if config is None else config if isinstance(config, str) else tuple(config)


def run_checks(emit, config=None, m=1) -> bool:
    """m: rows of x (1, or 2 for the two-row GEMV)."""
    ok_all = True
    for fmt, k, n, group, dtype, smooth, bias in check_cases():
        torch.manual_seed(k * 7 + n)
        w = random_weight(fmt, k, n, group, smooth)
        x = torch.randn(m, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        ref = w4a16.w4a16_gemm_ref(x, w, b)
        out = gemv(x, w, b, config)
        err = rel_err(out, ref)
        ok = bool(torch.isfinite(out).all()) and out.shape == ref.shape and err < TOL
        ok_all &= ok
        emit({"kind": "check", "M": m, "config": config or default_config(m, fmt), "fmt": fmt, "group": group, "K": k,
              "N": n, "dtype": str(dtype).removeprefix("torch."), "smooth": smooth, "bias": bias, "rel_err": err,
              "tol": TOL, "result": "PASS" if ok else "FAIL"})
    if DRY_RUN:
        return ok_all
    for fmt in ("int4", "nvfp4"):  # graph replay on new x (no state between launches, but the engine replays graphs)
        w = random_weight(fmt, 4096, 4096)
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        gemv(x, w, config=config)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = gemv(x, w, config=config)
        errs = []
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            g.replay()
            errs.append(rel_err(out, w4a16.w4a16_gemm_ref(x, w)))
        ok = max(errs) < TOL
        ok_all &= ok
        emit({"kind": "check", "M": m, "config": config or default_config(m, fmt), "fmt": fmt, "K": 4096, "N": 4096,
              "graph_replays": 2, "rel_err": max(errs), "tol": TOL, "result": "PASS" if ok else "FAIL"})
    return ok_all


# ---- timing
def graph_time_us(fns, reps) -> float:
    """Median per-call time of a CUDA graph that calls every fn in fns once (repeated to >= MIN_CALLS calls)."""
    if DRY_RUN:
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    calls = fns * -(-MIN_CALLS // len(fns))
    return load_script("kernels.py").time_us(calls, reps)


def per_token_table(rows, ms, cols) -> str:
    """Markdown: per M, each column's us summed over the rows of that M (the four shapes) x LAYERS, in ms."""
    out = ["| M | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in ms:
        per = [sum(r[c] for r in rows if r["M"] == m) * LAYERS / 1e3 for c in cols]
        out.append(f"| {m} | " + " | ".join(f"{v:.3f}" for v in per) + " |")
    return "\n".join(out)


def copies_for(nbytes) -> int:
    return max(1, min(64, -(-4 * L2_BYTES // nbytes)))


def run_timing(reps, emit, smooth=False, configs=(None,), m=1):
    """smooth: INT4 weights carry a pre_quant_scale (real AWQ checkpoints do; the engine's dummy weights do not).
    configs: GEMV configs timed on the same weights (None: the default for m rows). m = 2: also what w4a16_gemm
    runs without the GEMV (config "tensor_core": w4_small_m or the tensor-core kernel, w4a16_gemm's route for
    M >= 3)."""
    rows = []
    for shape, k, n in SHAPES:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(2 * n * k))]
        us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws[:2 if DRY_RUN else None]], reps)
        del ws
        cublas = us
        rows.append({"kind": "time", "shape": shape, "K": k, "N": n, "fmt": "bf16", "op": "cublas_bf16",
                     "us": us, "GBps": 2 * n * k / us / 1e3})
        emit(rows[-1])
        for fmt in ("int4", "nvfp4"):
            nbytes = weight_bytes(fmt, k, n)
            ws = [random_weight(fmt, k, n, smooth=smooth and fmt == "int4")
                  for _ in range(1 if DRY_RUN else copies_for(nbytes))]
            ops = [("w4_gemv", c, lambda w, c=c: gemv(x, w, config=c)) for c in configs]
            if m > 1:
                ops.append(("w4a16_gemm", "tensor_core", lambda w: w4a16.tensor_core_gemm(x, w)))
            for op, config, fn in ops:
                us = graph_time_us([lambda w=w: fn(w) for w in ws], reps)
                rows.append({"kind": "time", "M": m, "shape": shape, "K": k, "N": n, "fmt": fmt, "op": op,
                             "config": config_key(config), "us": us,
                             "GBps": nbytes / us / 1e3, "speedup_vs_cublas": cublas / us})
                emit(rows[-1])
            del ws
        if not DRY_RUN:
            torch.cuda.empty_cache()
    return rows


def table(rows, config, m=1) -> str:
    """Markdown for one config ("tensor_core": the route without the GEMV): per shape, us (weight+scale GB/s) and
    speedup over cuBLAS bf16 per format; then per-token sums."""
    config = config_key(config)
    get = {(r["shape"], r["fmt"]): r for r in rows if r["fmt"] == "bf16" or r["config"] == config}
    out = [f"\n### M = {m}, GEMV config (BLOCK_N, BLOCK_K, num_warps) = {config}\n",
           "| shape | cuBLAS bf16 us | INT4 g128 us (GB/s) | x cuBLAS | NVFP4 us (GB/s) | x cuBLAS |",
           "|---|---|---|---|---|---|"]
    sums = {"bf16": 0.0, "int4": 0.0, "nvfp4": 0.0}
    for shape, k, n in SHAPES:
        cells = [f"{get[shape, 'bf16']['us']:.1f}"]
        for fmt in ("int4", "nvfp4"):
            r = get[shape, fmt]
            cells += [f"{r['us']:.1f} ({r['GBps']:.0f})", f"{r['speedup_vs_cublas']:.2f}x"]
        for fmt in sums:
            sums[fmt] += get[shape, fmt]["us"]
        out.append(f"| {shape} {k}->{n} | " + " | ".join(cells) + " |")
    out.append(f"| per token (x{LAYERS}), ms | {LAYERS * sums['bf16'] / 1e3:.3f} | {LAYERS * sums['int4'] / 1e3:.3f} | "
               f"{sums['bf16'] / sums['int4']:.2f}x | {LAYERS * sums['nvfp4'] / 1e3:.3f} | "
               f"{sums['bf16'] / sums['nvfp4']:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="graph replays per timing (median)")
    ap.add_argument("--json", type=Path, help="write every JSON line to this file too")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--smooth", action="store_true", help="time INT4 with pre_quant_scale (as AWQ checkpoints)")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test of the script (interpreter, tiny shapes)")
    ap.add_argument("--configs", default="", help="more GEMV configs, BN,BK,W;... (checked, then timed)")
    ap.add_argument("--m2", action="store_true",
                    help="x of two rows: the two-row GEMV against w4_small_m / the tensor-core kernel")
    args = ap.parse_args(argv)
    extra = gemv_configs(ap, "--configs", args.configs)
    bad = [c for c in extra if c[0] % 4 or c[1] % (1024 * c[2])]
    if bad:
        ap.error(f"--configs {bad}: BN a multiple of 4, BK a multiple of 1024 x W")
    if not DRY_RUN and not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    lines = []

    def emit(d):
        d = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}
        lines.append(d)
        print(json.dumps(d, default=str), flush=True)

    t0 = time.time()
    emit({"kind": "env", "device": "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name(),
          "torch": torch.__version__, "triton": __import__("triton").__version__, "config": dict(tuning.current().w4_gemv_config)})
    ok = True
    configs = [None] + extra
    m = 2 if args.m2 else 1
    if not args.no_checks:
        for config in configs:
            ok &= run_checks(emit, config, m)
        emit({"kind": "checks_done", "all_pass": ok, "s": time.time() - t0})
    rows = run_timing(args.reps, emit, args.smooth, configs, m)
    emit({"kind": "done", "s": time.time() - t0, "all_pass": ok})
    for config in configs + (["tensor_core"] if m > 1 else []):
        print(table(rows, config, m))
    if args.json:
        args.json.write_text("\n".join(json.dumps(d, default=str) for d in lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
