"""FP8 decode GEMV (lowbit.kernels.fp8_gemv, M = 1) on the GPU: correctness, then time vs today's kernels.

`python3 bench/fp8_gemv_bench.py [--configs 8x1024x2,8x1024x2x2] [--budget-s S] [--json FILE] [--reps N]
[--no-checks]` (from the repo root; ~1-2 min on an H200, mostly Triton compiles; `--dry-run`: CPU smoke test of the
script under the interpreter, tiny shapes). A config is BLOCK_NxBLOCK_KxWARPS[xAHEAD]; default fp8_gemv.CANDIDATES.
1. checks every config against scaled_gemm_ref (fp32 math, bf16 output) on fresh random inputs on the GPU: the four
   Llama-3.1-8B shapes with the engine's scale kinds (per-row weight scales [N, 1] for the merged qkv and gate_up,
   per-tensor for o and down), ragged K (not a multiple of BLOCK_K, one not of 16) and odd N with bias and per-row
   [N] scales, fp16 output, and CUDA-graph replays on new x. rel err = ||out - ref|| / ||ref||, PASS below TOL;
   also the fp32 output against an fp64 reference (PASS below TOL_FP32) beside fp8_small_m's fp32 output error
   (information: its wgmma sums). Exit 1 if any check fails (timing still runs).
2. times at M = 1: each config, fp8_small_m_gemm (today's M = 1 route, same scales), torch._scaled_mm per-tensor
   (cuBLAS's floor: it cannot apply per-row scales) and cuBLAS bf16 (F.linear). Medians over REPS replays of a CUDA
   graph that calls the op once per weight copy, with enough copies (>= 20 calls, > 4x L2 of weights) that every
   call streams its weights from HBM. GB/s = weight bytes / time. --budget-s: once past it, configs other than
   fp8_gemv.DEFAULT_CONFIG are no longer timed (the baselines and the default always are).
Prints JSON lines (one per check and per timing) and a markdown table (us (GB/s) per shape, ms per token for 32
layers, the best config per shape); --json writes the lines to a file too.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without pip install -e

from lowbit.bench_cli import load_script  # noqa: E402
from lowbit.kernels import fp8_gemv  # noqa: E402
from lowbit.kernels.fp8_small_m import fp8_small_m_gemm  # noqa: E402
from lowbit.kernels.scaled_gemm import scaled_gemm_ref  # noqa: E402

W4 = load_script("w4_gemv_bench.py")  # graph_time_us, copies_for (its DRY_RUN comes from the same argv)
DEV = "cpu" if DRY_RUN else "cuda"
# (name, K, N, per-row weight scales as the engine's merged projections)
SHAPES = [("qkv", 4096, 6144, True), ("o", 4096, 4096, False), ("gate_up", 4096, 28672, True),
          ("down", 14336, 4096, False)]
if DRY_RUN:
    SHAPES = [("qkv", 2048, 24, True), ("o", 2048, 16, False), ("gate_up", 2048, 40, True), ("down", 3072, 16, False)]
LAYERS = 32  # Llama-3.1-8B: per-token figures = 32 x the four shapes
TOL = 2e-3  # both sides rounded to bf16/fp16 from fp32 sums in another order: only rounding flips differ
TOL_FP32 = 1e-5  # fp32 output vs fp64: exact e4m3 products, fp32 sums only (~1e-7 under the interpreter)
if DRY_RUN:
    TOL = 1e-2  # the interpreter truncates fp32 -> bf16 (~4e-3), the GPU rounds


def parse_config(text: str) -> fp8_gemv.GemvConfig:
    return fp8_gemv.GemvConfig(*(int(v) for v in text.lower().split("x")))


def name(cfg) -> str:
    return "x".join(str(v) for v in cfg)


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-300)).item()


def fp8(t):
    return t.clamp(-448, 448).to(torch.float8_e4m3fn)


def inputs(k, n, per_row, seed, dev=None):
    """x, w with |values| up to a few hundred (as FP8 checkpoints), static scale_a, scale_b [N, 1] or []."""
    dev = dev or DEV
    g = torch.Generator(device=dev).manual_seed(seed)
    x = fp8(torch.randn(1, k, device=dev, generator=g) * 30)
    w = fp8(torch.randn(n, k, device=dev, generator=g) * 100)
    sa = torch.tensor(0.01, device=dev)
    sb = torch.rand(n, 1, device=dev, generator=g) * 1e-3 + 1e-5 if per_row else torch.tensor(2e-4, device=dev)
    return x, w, sa, sb


def small_m(x, w, sa, sb, bias=None, out_dtype=torch.bfloat16):
    return fp8_small_m_gemm(x, w, sa, sb, bias, out_dtype, dot_fp16=DRY_RUN)  # fp16 dot: interpreter only


def ref64(x, w, sa, sb, bias=None):
    out = (x.double() @ w.double().t()) * sa.double() * sb.double().reshape(1, -1)
    return out + bias.double() if bias is not None else out


# ---- checks
def check_cases():
    """(K, N, scale_b kind None / "n" / "n1", bias, out dtype): served shapes, then ragged ones."""
    cases = [(k, n, "n1" if per_row else None, False, torch.bfloat16) for _, k, n, per_row in SHAPES]
    cases += [
        (1000, 1030, "n", True, torch.bfloat16),  # K < BLOCK_K, K % 16 != 0
        (4096 + 320, 77, None, True, torch.float16),  # ragged last step, odd N
        (14336 + 48, 4099, "n1", True, torch.bfloat16),
    ]
    if DRY_RUN:
        cases = [(k, min(n, 18) + n % 2, s, b, d) for k, n, s, b, d in cases if k < 5000]
    return cases


def run_checks(configs, emit) -> bool:
    ok_all = True
    for k, n, sb_kind, bias, dtype in check_cases():
        x, w, sa, sb = inputs(k, n, sb_kind == "n1", seed=k * 7 + n)
        if sb_kind == "n":
            sb = sb.reshape(-1)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        ref = scaled_gemm_ref(x, w, sa, sb, b, dtype)
        exact = ref64(x, w, sa, sb, b)
        base = {"kind": "check", "K": k, "N": n, "scale_b": sb_kind or "tensor", "bias": bias,
                "dtype": str(dtype).removeprefix("torch.")}
        sm_err = rel_err(small_m(x, w, sa, sb, b, torch.float32), exact)
        for cfg in configs:
            out = fp8_gemv.fp8_gemv(x, w, sa, sb, b, dtype, cfg)
            err = rel_err(out, ref)
            err32 = rel_err(fp8_gemv.fp8_gemv(x, w, sa, sb, b, torch.float32, cfg), exact)
            ok = bool(torch.isfinite(out).all()) and out.shape == ref.shape and err < TOL and err32 < TOL_FP32
            ok_all &= ok
            emit(dict(base, config=name(cfg), rel_err=err, tol=TOL, rel_err_fp32=err32, tol_fp32=TOL_FP32,
                      small_m_rel_err_fp32=sm_err, result="PASS" if ok else "FAIL"))
        del w
    if DRY_RUN:
        return ok_all
    for cfg in configs:  # graph replay on new x (no state between launches, but the engine replays graphs)
        x, w, sa, sb = inputs(4096, 4096, True, seed=11)
        fp8_gemv.fp8_gemv(x, w, sa, sb, None, torch.bfloat16, cfg)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fp8_gemv.fp8_gemv(x, w, sa, sb, None, torch.bfloat16, cfg)
        errs = []
        for _ in range(2):
            x.copy_(fp8(torch.randn(1, 4096, device=DEV) * 30))
            out.fill_(float("nan"))
            g.replay()
            errs.append(rel_err(out, scaled_gemm_ref(x, w, sa, sb, None, torch.bfloat16)))
        ok = max(errs) < TOL
        ok_all &= ok
        emit({"kind": "check", "K": 4096, "N": 4096, "scale_b": "n1", "config": name(cfg), "graph_replays": 2,
              "rel_err": max(errs), "tol": TOL, "result": "PASS" if ok else "FAIL"})
    return ok_all


# ---- timing
def run_timing(configs, reps, deadline, emit):
    rows = []

    def record(shape, k, n, op, us, nbytes, **extra):
        rows.append(dict({"kind": "time", "shape": shape, "K": k, "N": n, "op": op, "us": us,
                          "GBps": nbytes / us / 1e3}, **extra))
        emit(rows[-1])

    for shape, k, n, per_row in SHAPES:
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(W4.copies_for(2 * n * k))]
        us = W4.graph_time_us([lambda w=w: F.linear(x, w) for w in ws[:2 if DRY_RUN else None]], reps)
        record(shape, k, n, "cublas_bf16", us, 2 * n * k)
        del ws
        states = [inputs(k, n, per_row, seed=i) for i in range(1 if DRY_RUN else W4.copies_for(n * k))]
        xq = states[0][0]
        if not DRY_RUN:  # cuBLAS fp8: the GPU's (torch CPU builds time a reference loop, not worth a row)
            one = torch.ones((), device=DEV)
            record(shape, k, n, "scaled_mm_tensor", W4.graph_time_us(
                [lambda w=w, sa=sa: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16)
                 for _, w, sa, _ in states], reps), n * k)
        record(shape, k, n, "fp8_small_m", W4.graph_time_us(
            [lambda w=w, sa=sa, sb=sb: small_m(xq, w, sa, sb) for _, w, sa, sb in states], reps), n * k)
        for cfg in configs:
            if time.time() > deadline and cfg != fp8_gemv.DEFAULT_CONFIG:
                emit({"kind": "skipped", "shape": shape, "config": name(cfg), "reason": "--budget-s"})
                continue
            record(shape, k, n, "fp8_gemv", W4.graph_time_us(
                [lambda w=w, sa=sa, sb=sb: fp8_gemv.fp8_gemv(xq, w, sa, sb, config=cfg) for _, w, sa, sb in states],
                reps), n * k, config=name(cfg), default=cfg == fp8_gemv.choose_config(n, k))
        del states
        if not DRY_RUN:
            torch.cuda.empty_cache()
    return rows


def table(rows, configs) -> str:
    """Markdown: us (GB/s) per shape and op, the best GEMV config per shape; per-token sums (x LAYERS)."""
    get = {(r["shape"], r["op"], r.get("config")): r for r in rows}
    ops = [(op, None) for op in ("cublas_bf16", "scaled_mm_tensor", "fp8_small_m")
           if any(r["op"] == op for r in rows)] + [("fp8_gemv", name(c)) for c in configs]
    heads = {"cublas_bf16": "cuBLAS bf16", "scaled_mm_tensor": "_scaled_mm per-tensor", "fp8_small_m": "fp8_small_m"}
    out = ["\n### M = 1, us (weight GB/s); fp8_gemv columns are configs BLOCK_NxBLOCK_KxWARPSxAHEAD\n",
           "| shape | " + " | ".join(heads.get(op) or f"gemv {c}" for op, c in ops) + " | best gemv | x fp8_small_m |",
           "|---" * (len(ops) + 3) + "|"]
    sums = {oc: 0.0 for oc in ops}
    best_sum = small_sum = 0.0
    for shape, k, n, per_row in SHAPES:
        cells = []
        for oc in ops:
            r = get.get((shape, *oc))
            cells.append(f"{r['us']:.2f} ({r['GBps']:.0f})" if r else "-")
            sums[oc] = sums[oc] + r["us"] if r and sums[oc] is not None else None
        gemvs = [r for (s, op, _), r in get.items() if s == shape and op == "fp8_gemv"]
        best = min(gemvs, key=lambda r: r["us"])
        small = get[shape, "fp8_small_m", None]["us"]
        best_sum += best["us"]
        small_sum += small
        out.append(f"| {shape} {k}->{n}{' (per-row)' if per_row else ''} | " + " | ".join(cells)
                   + f" | {best['config']} {best['us']:.2f} | {small / best['us']:.2f}x |")
    tok = [f"{LAYERS * s / 1e3:.3f}" if s is not None else "-" for s in sums.values()]
    out.append(f"| per token (x{LAYERS}), ms | " + " | ".join(tok)
               + f" | {LAYERS * best_sum / 1e3:.3f} | {small_sum / best_sum:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", help="comma-separated BLOCK_NxBLOCK_KxWARPS[xAHEAD] (default: fp8_gemv.CANDIDATES)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing non-default configs after this")
    ap.add_argument("--reps", type=int, default=15, help="graph replays per timing (median)")
    ap.add_argument("--json", type=Path, help="write every JSON line to this file too")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test of the script (interpreter, tiny shapes)")
    args = ap.parse_args(argv)
    if not DRY_RUN and not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = [parse_config(c) for c in args.configs.split(",")] if args.configs else list(fp8_gemv.CANDIDATES)
    lines = []

    def emit(d):
        d = {k: (round(v, 9) if isinstance(v, float) else v) for k, v in d.items()}
        lines.append(d)
        print(json.dumps(d, default=str), flush=True)

    t0 = time.time()
    emit({"kind": "env", "device": "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name(),
          "torch": torch.__version__, "triton": __import__("triton").__version__,
          "configs": [name(c) for c in configs], "default": name(fp8_gemv.DEFAULT_CONFIG)})
    ok = True
    if not args.no_checks:
        ok = run_checks(configs, emit)
        emit({"kind": "checks_done", "all_pass": ok, "s": time.time() - t0})
    rows = run_timing(configs, args.reps, t0 + args.budget_s, emit)
    emit({"kind": "done", "s": time.time() - t0, "all_pass": ok})
    print(table(rows, configs))
    if args.json:
        args.json.write_text("\n".join(json.dumps(d, default=str) for d in lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
