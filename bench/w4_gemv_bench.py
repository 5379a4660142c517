"""W4A16 decode GEMV (lowbit.kernels.w4_gemv, M = 1) on the GPU: the current kernel (v1) against the "wide" variants.

`python3 bench/w4_gemv_bench.py [--quick] [--smooth] [--json FILE] [--reps N] [--budget-s S]` (from the repo root;
~1-2 min on an H200, mostly Triton compiles; past --budget-s (130) only the --quick variants are timed):
1. checks every variant against the torch reference w4a16_gemm_ref (fp32 math) on fresh random inputs on the GPU:
   INT4 (group 128, plus 16/32 on ragged shapes) and NVFP4, the four Llama-3.1-8B shapes, ragged K (padded to 128,
   not a multiple of BLOCK_K) and odd N with pre_quant_scale and bias, bf16 and fp16 x; rel err = ||out - ref|| /
   ||ref|| (both rounded to x's dtype), PASS below TOL; exit 1 if any check fails (timing still runs).
2. times each variant at M = 1 on qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096 for INT4
   (group 128) and NVFP4, plus cuBLAS bf16 (F.linear) as a reference. Times are medians over REPS replays of a
   CUDA graph that calls the op once per weight copy, with enough copies (>= 20 calls, > 4x L2 of weights) that
   every call streams its weights from HBM; so launch overhead is amortized as in the engine's graphs.
   GB/s = (weight + scale bytes) / time.
Prints JSON lines (one per check and per timing) and a final markdown table; --json writes them all to a file.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DRY_RUN = "--dry-run" in sys.argv  # CPU smoke test of this script under the Triton interpreter (tiny shapes)
if DRY_RUN:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without pip install -e

from lowbit.kernels import w4_gemv, w4a16  # noqa: E402

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

# name -> config for w4_gemv.w4_gemv. Wide: ("wide", BLOCK_N, BLOCK_K, num_warps, PREFETCH); each thread holds
# BLOCK_N rows x BLOCK_K / (32 x num_warps) k of a step (one 16-byte load per row and 32 k)
VARIANTS = {
    "v1": w4_gemv.choose_gemv_config(1, 4096, 4096, "int4", "v1"),  # the current default (4, 2048, 4, False)
    "wide_8x2048w2": ("wide", 8, 2048, 2, False),  # choose_wide_config's default
    "wide_8x4096w4": ("wide", 8, 4096, 4, False),  # one step for K = 4096 (down: 3.5 steps, the last one masked)
    "wide_4x2048w1": ("wide", 4, 2048, 1, False),  # 1-warp programs, 2 chunks per thread
    "wide_16x2048w2": ("wide", 16, 2048, 2, False),  # INT4 only (255 registers, no spills; NVFP4 would spill)
}
QUICK = ["v1", "wide_8x2048w2", "wide_8x4096w4"]
BASE = "wide_8x2048w2"
CONTROLS = {  # the BASE config with one thing changed (full mode only)
    "wide_8x2048w2_pf": ("prefetch", True),  # next step's words loaded during this step (ptxas sinks them mid-step)
    "wide_8x2048w2_L1": ("cache", ""),  # weight loads also cached in L1 (default .cg: L2 only)
    "wide_8x2048w2_noasm": ("asm", False),  # NVFP4 only: fp16 -> fp32 in Triton (+1 PRMT per pair) not inline PTX
}


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


def call(name, config, x, w, bias=None):
    """One variant's op; controls flip one switch of BASE (read at launch, so a graph capture keeps it)."""
    if name in CONTROLS:
        what, value = CONTROLS[name]
        base = VARIANTS[BASE]
        if what == "prefetch":
            return w4_gemv.w4_gemv(x, w, bias, base[:4] + (value,))
        if what == "cache":
            old, w4_gemv.WIDE_WEIGHT_CACHE = w4_gemv.WIDE_WEIGHT_CACHE, value
            try:
                return w4_gemv.w4_gemv(x, w, bias, base)
            finally:
                w4_gemv.WIDE_WEIGHT_CACHE = old
        return w4_gemv._w4_gemv_wide(x.contiguous(), w, bias, *base[1:], use_asm=value)
    return w4_gemv.w4_gemv(x, w, bias, config)


def applies(name, fmt) -> bool:
    if name == "wide_16x2048w2" and fmt == "nvfp4":
        return False
    if name == "wide_8x2048w2_noasm" and fmt == "int4":
        return False
    return True


# ---- checks
def check_cases(quick):
    """(fmt, K, N, group, x dtype, smooth, bias, which variants: 'all' or 'some')."""
    cases = []
    for _, k, n in SHAPES if not quick else SHAPES[1:2] + SHAPES[3:]:
        cases += [("int4", k, n, 128, torch.bfloat16, False, False, "all"),
                  ("nvfp4", k, n, 16, torch.bfloat16, False, False, "all")]
    cases += [
        ("int4", 1152, 1030, 128, torch.bfloat16, True, True, "some"),  # K = 9 x 128: no BLOCK_K divides it
        ("nvfp4", 2000, 1001, 16, torch.bfloat16, True, True, "some"),  # K padded to 2048, odd N
        ("int4", 4096 + 416, 102, 32, torch.float16, True, True, "some"),
        ("int4", 3088, 66, 16, torch.bfloat16, False, True, "some"),  # groups of 16: two scales per chunk
        ("nvfp4", 14336, 130, 16, torch.float16, True, False, "some"),
    ]
    if DRY_RUN:
        cases = [(f, k, min(n, 18) + n % 2, g, d, sm, b, which) for f, k, n, g, d, sm, b, which in cases if k < 5000]
    return cases


def run_checks(names, quick, emit) -> bool:
    ok_all = True
    some = {"v1", BASE, "wide_8x4096w4", "wide_8x2048w2_noasm"}  # the ragged cases: distinct code paths only
    for fmt, k, n, group, dtype, smooth, bias, which in check_cases(quick):
        torch.manual_seed(k * 7 + n)
        w = random_weight(fmt, k, n, group, smooth)
        x = torch.randn(1, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        ref = w4a16.w4a16_gemm_ref(x, w, b)
        for name in names:
            if not applies(name, fmt) or (which == "some" and name not in some):
                continue
            out = call(name, VARIANTS.get(name), x, w, b)
            err = rel_err(out, ref)
            ok = bool(torch.isfinite(out).all()) and out.shape == ref.shape and err < TOL
            ok_all &= ok
            emit({"kind": "check", "variant": name, "fmt": fmt, "group": group, "K": k, "N": n,
                  "dtype": str(dtype).removeprefix("torch."), "smooth": smooth, "bias": bias, "rel_err": err,
                  "tol": TOL, "result": "PASS" if ok else "FAIL"})
    # graph replay on new x (no state between launches, but the engine replays graphs)
    if DRY_RUN:
        return ok_all
    w = random_weight("nvfp4", 4096, 4096)
    x = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    for name in names:
        if not name.startswith("wide") or name in CONTROLS:
            continue
        call(name, VARIANTS[name], x, w)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = call(name, VARIANTS[name], x, w)
        errs = []
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            g.replay()
            errs.append(rel_err(out, w4a16.w4a16_gemm_ref(x, w)))
        ok = max(errs) < TOL
        ok_all &= ok
        emit({"kind": "check", "variant": name, "fmt": "nvfp4", "K": 4096, "N": 4096, "graph_replays": 2,
              "rel_err": max(errs), "tol": TOL, "result": "PASS" if ok else "FAIL"})
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:  # compile and warm outside the capture
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    del graph
    return statistics.median(times)


def copies_for(nbytes) -> int:
    return max(1, min(64, -(-4 * L2_BYTES // nbytes)))


def run_timing(names, reps, emit, deadline, smooth=False):
    """Past the deadline (time.time()), only the QUICK variants are timed. smooth: INT4 weights carry a
    pre_quant_scale (real AWQ checkpoints do; the engine's dummy weights, profiled at 22.3 us per launch, do not)."""
    rows = []
    for shape, k, n in SHAPES:
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(2 * n * k))]
        us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws[:2 if DRY_RUN else None]], reps)
        del ws
        rows.append({"kind": "time", "shape": shape, "K": k, "N": n, "fmt": "bf16", "variant": "cublas_bf16",
                     "us": us, "GBps": 2 * n * k / us / 1e3})
        emit(rows[-1])
        for fmt in ("int4", "nvfp4"):
            nbytes = weight_bytes(fmt, k, n)
            ws = [random_weight(fmt, k, n, smooth=smooth and fmt == "int4")
                  for _ in range(1 if DRY_RUN else copies_for(nbytes))]
            base = None
            for name in names:
                if not applies(name, fmt) or (time.time() > deadline and name not in QUICK):
                    continue
                t0 = time.time()
                us = graph_time_us([lambda w=w, name=name: call(name, VARIANTS.get(name), x, w) for w in ws], reps)
                base = us if name == "v1" else base
                rows.append({"kind": "time", "shape": shape, "K": k, "N": n, "fmt": fmt, "variant": name,
                             "config": VARIANTS.get(name) or CONTROLS.get(name),
                             "us": us, "GBps": nbytes / us / 1e3, "speedup_vs_v1": base / us if base else None,
                             "wall_s": time.time() - t0})
                emit(rows[-1])
            del ws
        torch.cuda.empty_cache()
    return rows


def table(rows, names) -> str:
    """Markdown: per shape and format, us (GB/s) of each variant, speedup over v1; then per-token sums."""
    out = []
    for fmt in ("int4", "nvfp4"):
        cols = [v for v in names if applies(v, fmt)]
        out.append(f"\n### {fmt} (M = 1; us, weight+scale GB/s, speedup vs v1)\n")
        out.append("| shape | cuBLAS bf16 us | " + " | ".join(cols) + " |")
        out.append("|---|---|" + "---|" * len(cols))
        sums = {v: 0.0 for v in cols}
        sums["cublas_bf16"] = 0.0
        for shape, k, n in SHAPES:
            get = {r["variant"]: r for r in rows if r["shape"] == shape and r["fmt"] in (fmt, "bf16")}
            cells = []
            for v in cols:
                r = get.get(v)
                if r is None:
                    cells.append("-")
                    continue
                sums[v] += r["us"]
                sp = f" {r['speedup_vs_v1']:.2f}x" if r.get("speedup_vs_v1") and v != "v1" else ""
                cells.append(f"{r['us']:.1f} ({r['GBps']:.0f}){sp}")
            cub = get.get("cublas_bf16")
            sums["cublas_bf16"] += cub["us"] if cub else 0.0
            out.append(f"| {shape} {k}->{n} | {cub['us']:.1f} | " + " | ".join(cells) + " |" if cub else "")
        timed = {v: sum(1 for r in rows if r["fmt"] == fmt and r["variant"] == v) for v in cols}
        for v in cols:
            if timed[v] < len(SHAPES):  # skipped past the budget: no per-token figure
                sums[v] = float("inf")
        per_token = " | ".join(f"{LAYERS * sums[v] / 1e3:.3f}" for v in cols)
        out.append(f"| per token (x{LAYERS}), ms | {LAYERS * sums['cublas_bf16'] / 1e3:.3f} | {per_token} |")
        best = min(cols, key=lambda v: sums[v])
        out.append(f"\nbest {fmt} over the four shapes: {best} ({LAYERS * sums[best] / 1e3:.3f} ms per token vs v1 "
                   f"{LAYERS * sums['v1'] / 1e3:.3f}, {sums['v1'] / sums[best]:.2f}x); config "
                   f"{VARIANTS.get(best) or (BASE, CONTROLS.get(best))}")
        for shape, k, n in SHAPES:
            cand = [r for r in rows if r["shape"] == shape and r["fmt"] == fmt]
            b = min(cand, key=lambda r: r["us"])
            out.append(f"- {shape}: fastest {b['variant']} {b['us']:.1f} us ({b['GBps']:.0f} GB/s)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"variants {QUICK} only, fewer checks")
    ap.add_argument("--reps", type=int, default=15, help="graph replays per timing (median)")
    ap.add_argument("--json", type=Path, help="write every JSON line to this file too")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--budget-s", type=float, default=130, help="after this many seconds time only the quick set")
    ap.add_argument("--smooth", action="store_true", help="time INT4 with pre_quant_scale (as AWQ checkpoints)")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test of the script (interpreter, tiny shapes)")
    args = ap.parse_args(argv)
    if not DRY_RUN and not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = QUICK if args.quick else list(VARIANTS) + list(CONTROLS)
    lines = []

    def emit(d):
        d = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}
        lines.append(d)
        print(json.dumps(d, default=str), flush=True)

    t0 = time.time()
    emit({"kind": "env", "device": "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name(),
          "torch": torch.__version__, "triton": __import__("triton").__version__, "variants": names})
    ok = True
    if not args.no_checks:
        ok = run_checks(names, args.quick, emit)
        emit({"kind": "checks_done", "all_pass": ok, "s": time.time() - t0})
    rows = run_timing(names, args.reps, emit, t0 + args.budget_s, args.smooth)
    emit({"kind": "done", "s": time.time() - t0, "all_pass": ok})
    print(table(rows, names))
    if args.json:
        args.json.write_text("\n".join(json.dumps(d, default=str) for d in lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
