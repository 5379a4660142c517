"""`lowbit bench kernels`: lowbit's GEMMs against cuBLAS bf16 and torch._scaled_mm on Llama-3.1-8B linear shapes.

Times are medians of CUDA-graph replays; each replay calls the op once per copy of the weights, with enough copies
that they do not fit in L2 (so decode shapes stream weights from HBM, as in a real forward pass). Prints a markdown
table (median us, TFLOP/s, GB/s, speedup over cuBLAS bf16 and over _scaled_mm alone); --json writes every number.
"""
import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit import formats
from lowbit.kernels import dense_linear, linear, prepare_linear, rms_norm, rms_norm_ref, silu_and_mul
from lowbit.kernels import tuning
from lowbit.kernels.linear import scaled_gemm as sg
from lowbit.kernels import silu_and_mul_ref
from lowbit.kernels.linear import w4_gemv, w4_small_m, w4a16

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (in, out): qkv, o, gate_up, down
MS = [1, 16, 64, 256, 4096]
L2_BYTES = 60 * 2**20
MIN_CALLS = 16  # per graph replay, so the replay's own launch cost is amortized
VARIANTS = ["bf16_cublas", "bf16_linear", "fp8_scaled_mm", "fp8_linear", "fp8_rowwise_linear", "int8_gemm",
            "int8_linear", "int_mm", "w4_int4", "w4_nvfp4"]  # bf16_linear: dense_linear (the GEMV at M = 1)


def time_us(calls, reps: int) -> float:
    """Median per-call time of a CUDA graph that runs every callable in `calls` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:  # compile and warm outside the capture
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
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


def copies_for(weight_bytes: int) -> int:
    return max(1, min(64, -(-4 * L2_BYTES // weight_bytes)))


# ---- weights: random values at real shapes (packed formats get random but valid bytes)
def make_weights(variant, k, n, dev):
    """-> (bytes of one weight copy, factory() returning one fresh copy as the op's state)."""
    if variant in ("bf16_cublas", "bf16_linear"):
        return 2 * n * k, lambda: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    if variant in ("fp8_scaled_mm", "fp8_linear", "fp8_rowwise_linear", "fp8_rowwise_scaled_mm"):
        fmt = formats.FP8_PER_CHANNEL_PER_TOKEN if "rowwise" in variant else formats.FP8
        return n * k, lambda: prepare_linear(fmt.name, _fp8_tensors(fmt, k, n, dev), dev)
    if variant in ("int8_gemm", "int8_linear", "int_mm"):
        return n * k, lambda: prepare_linear(formats.W8A8_SQ_PER_CHANNEL.name, _int8_tensors(k, n, dev), dev)
    fmt = "int4" if variant == "w4_int4" else "nvfp4"
    scale_bytes = (4 * n * k // 128) if fmt == "int4" else n * k // 16
    return n * k // 2 + scale_bytes, lambda: _w4_weight(fmt, k, n, dev)


def _fp8_tensors(fmt, k, n, dev):
    t = {"weight": (torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)}
    if not fmt.dynamic_per_token:  # static: a per-tensor weight scale and the input_scale
        t.update(weight_scale=torch.tensor(2e-4, device=dev), input_scale=torch.tensor(4 / 448, device=dev))
    else:
        t["weight_scale"] = torch.rand(n, device=dev) * 4e-4
    return t


def _int8_tensors(k, n, dev):
    return {"weight": torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8),
            "weight_scale": torch.rand(n, device=dev) * 3e-4, "input_scale": torch.tensor(4 / 127, device=dev),
            "pre_quant_scale": (0.5 + torch.rand(k, device=dev)).to(torch.bfloat16)}


def _w4_weight(fmt, k, n, dev):
    qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
    if fmt == "int4":
        return w4a16.W4Weight("int4", qweight, torch.rand(k // 128, n, device=dev) * 1e-2, n, k, 128)
    scales = (torch.rand(k // 128, n, 8, device=dev) * 400 + 1).to(torch.float8_e4m3fn)
    return w4a16.W4Weight("nvfp4", qweight, scales, n, k, 16, 1e-4)


# ---- the ops, as callables over one weight copy
def make_call(variant, state, x, w4_config=None):
    m = x.shape[0]
    if variant == "bf16_cublas":
        return lambda: F.linear(x, state)
    if variant == "bf16_linear":
        return lambda: dense_linear(x, state)
    if variant == "fp8_scaled_mm":
        xq = x.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=x.device)
        return lambda: torch._scaled_mm(xq, state.weight.t(), scale_a=one, scale_b=state.weight_scale,
                                        out_dtype=torch.bfloat16)
    if variant == "fp8_rowwise_scaled_mm":
        xq = x.to(torch.float8_e4m3fn)
        sa = torch.rand(m, 1, device=x.device)
        sb = state.weight_scale.reshape(1, -1)
        return lambda: torch._scaled_mm(xq, state.weight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    if variant in ("fp8_linear", "fp8_rowwise_linear", "int8_linear"):
        return lambda: linear(x, state)
    if variant == "int8_gemm":
        xq = torch.randint(-127, 128, x.shape, device=x.device, dtype=torch.int8)
        sa = torch.rand(m, 1, device=x.device) * 1e-2
        return lambda: sg.scaled_gemm(xq, state.weight, sa, state.weight_scale, None, torch.bfloat16)
    if variant == "int_mm":
        xq = torch.randint(-127, 128, x.shape, device=x.device, dtype=torch.int8)
        wt = state.weight.t()
        return lambda: torch._int_mm(xq, wt)
    return lambda: w4a16.w4a16_gemm(x, state, None, w4_config)


def applicable(variant, m):
    return not (variant == "int_mm" and m <= 16)


def bench_one(variant, k, n, m, dev, reps, w4_config=None):
    weight_bytes, factory = make_weights(variant, k, n, dev)
    states = [factory() for _ in range(copies_for(weight_bytes))]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    calls = [make_call(variant, s, x, w4_config) for s in states]
    repeat = -(-MIN_CALLS // len(calls)) if m <= 256 else 1
    us = time_us(calls * repeat, reps)
    moved = weight_bytes + 2 * m * k + 2 * m * n
    return {"variant": variant, "in": k, "out": n, "M": m, "us": us, "tflops": 2 * m * n * k / us / 1e6,
            "gbps": moved / us / 1e3, "copies": len(states)}


# ---- W4 config sweep (decode and prefill tiles)
def w4_candidates(m, k, stages=None):
    tiles = k // w4a16.PACK_K
    if stages:  # pipeline-depth experiment at the decode tiles the sweep picks
        return [(max(16, 1 << (m - 1).bit_length()), 64, s, 4, st) for s in (4, 8) for st in stages]
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        return [(bm, bn, s, w, 3) for bn, w in ((32, 4), (64, 4), (128, 8))
                for s in (1, 2, 4, 8, 16) if s <= tiles // 2]
    splits = (1, 2) if m <= 512 else (1,)
    return [(bm, bn, s, w, 3) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for s in splits
            if not (bm == 128 and bn == 128 and w == 4)]


def sweep_w4(shapes, ms, dev, reps, log, deadline, stages=None):
    best = {}
    for m in ms:  # small M first: if the budget runs out, prefill keeps its default tiles
        for k, n in shapes:
            for variant in ("w4_int4", "w4_nvfp4"):
                results = []
                for cfg in w4_candidates(m, k, stages):
                    if time.time() > deadline:
                        log("sweep budget spent")
                        return best
                    results.append((guarded(bench_one, variant, k, n, m, dev, reps, cfg)["us"], cfg))
                results.sort()
                best[(variant, k, n, m)] = results[0][1]
                log(f"sweep {variant} {m}x{k}->{n}: best {results[0][1]} {results[0][0]:.1f} us; "
                    f"default {w4a16.choose_config(m, n, k, variant[3:])}; top3 {results[:3]}")
    return best


def sweep_int8(shapes, dev, reps, log, m=4096):
    configs = [(128, 256, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3),
               (128, 128, 64, 4, 4), (128, 256, 128, 8, 4)]
    out = {}
    for k, n in shapes:
        res = []
        for cfg in configs:
            with tuning.override(scaled_gemm_configs=((None, cfg),)):
                r = guarded(bench_one, "int8_gemm", k, n, m, dev, reps)
            res.append((r["us"], cfg, r["tflops"]))
        res.sort()
        out[(k, n)] = res[0][1]
        log(f"sweep int8 {m}x{k}->{n}: " + "; ".join(f"{c} {t:.0f} TFLOP/s" for _, c, t in res))
    return out


def bench_fp8_producers(shapes, ms, dev, reps):
    """FP8 linear with its activation quantization fused into the producer (RMSNorm for in=4096, SiLU-and-mul for
    in=14336) against the same producer in bf16 followed by _scaled_mm on an already-quantized input."""
    rows = []
    for k, n in shapes:
        if k not in (4096, 14336):
            continue
        _, factory = make_weights("fp8_linear", k, n, dev)
        layers = [factory() for _ in range(copies_for(n * k))]
        for m in ms:
            rows.append(_bench_fp8_producer(layers, k, n, m, dev, reps))
    return rows


def _bench_fp8_producer(layers, k, n, m, dev, reps):
    if k == 4096:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = torch.rand(k, device=dev, dtype=torch.bfloat16)
        producer = lambda scale=None: rms_norm(x, w, 1e-5, res, scale)[0]  # noqa: E731
    else:
        g = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)
        producer = lambda scale=None: silu_and_mul(g, scale)  # noqa: E731
    xq = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=dev)
    def scaled_mm_alone(p):
        return torch._scaled_mm(xq, p.weight.t(), scale_a=one, scale_b=p.weight_scale, out_dtype=torch.bfloat16)

    paths = {
        "producer_bf16": lambda p: producer(),
        "scaled_mm_alone": scaled_mm_alone,
        "baseline": lambda p: (producer(), scaled_mm_alone(p)),  # the same two launches, quantization for free
        "fused": lambda p: linear(producer(p.input_scale), p),
        "unfused": lambda p: linear(producer(), p),
    }
    row = {"in": k, "out": n, "M": m, "producer": "rms_norm+residual" if k == 4096 else "silu_and_mul"}
    for name, fn in paths.items():
        calls = [(lambda p=p, fn=fn: fn(p)) for p in layers]
        row[name + "_us"] = time_us(calls * -(-MIN_CALLS // len(calls)), reps)
    row["ratio_fused"] = row["baseline_us"] / row["fused_us"]
    row["ratio_unfused"] = row["baseline_us"] / row["unfused_us"]
    print(f"fp8 producer {m}x{k}->{n}: {row}", flush=True)
    return row


def bench_elementwise(dev, reps):
    rows = []
    for m in (1, 64, 4096):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.rand(4096, device=dev, dtype=torch.bfloat16)
        g = torch.randn(m, 2 * 14336, device=dev, dtype=torch.bfloat16)
        ops = [("rms_norm+residual", lambda: rms_norm(x, w, 1e-5, r), lambda: rms_norm_ref(x, w, 1e-5, r)),
               ("silu_and_mul 14336", lambda: silu_and_mul(g), lambda: silu_and_mul_ref(g))]
        for name, fn, ref in ops:
            rows.append({"op": name, "M": m, "triton_us": time_us([fn] * MIN_CALLS, reps),
                         "torch_eager_us": time_us([ref] * MIN_CALLS, reps)})
    return rows


# ---- tables
def table(rows) -> str:
    base = {(r["in"], r["out"], r["M"]): r["us"] for r in rows if r["variant"] == "bf16_cublas"}
    fp8 = {(r["in"], r["out"], r["M"]): r["us"] for r in rows if r["variant"] == "fp8_scaled_mm"}
    lines = ["| in->out | M | kernel | median us | TFLOP/s | GB/s | x cuBLAS bf16 | x _scaled_mm |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = (r["in"], r["out"], r["M"])
        vs_bf16 = f"{base[key] / r['us']:.2f}" if key in base else "-"
        vs_fp8 = f"{fp8[key] / r['us']:.2f}" if key in fp8 else "-"
        lines.append(f"| {r['in']}->{r['out']} | {r['M']} | {r['variant']} | {r['us']:.1f} | {r['tflops']:.1f} | "
                     f"{r['gbps']:.0f} | {vs_bf16} | {vs_fp8} |")
    return "\n".join(lines)


def speedup_summary(rows) -> str:
    base = {(r["in"], r["out"], r["M"]): r["us"] for r in rows if r["variant"] == "bf16_cublas"}
    variants = [v for v in VARIANTS + ["fp8_rowwise_scaled_mm"]
                if v != "bf16_cublas" and any(r["variant"] == v for r in rows)]
    lines = ["| in->out | M | bf16 us | " + " | ".join(variants) + " |", "|---" * (3 + len(variants)) + "|"]
    for key in sorted(base, key=lambda k: (SHAPES.index(k[:2]) if k[:2] in SHAPES else 9, k[2])):
        cells = []
        for v in variants:
            r = [r for r in rows if r["variant"] == v and (r["in"], r["out"], r["M"]) == key]
            cells.append(f"{base[key] / r[0]['us']:.2f}x" if r else "-")
        lines.append(f"| {key[0]}->{key[1]} | {key[2]} | {base[key]:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_gemms(shapes, ms, variants, dev, reps, w4_best=None):
    rows = []
    for k, n in shapes:
        for m in ms:
            for v in variants:
                if applicable(v, m):
                    # decode rows time what w4a16_gemm dispatches to (the GEMV), not a swept tensor-core config
                    gemv = v.startswith("w4_") and m <= tuning.current().w4_gemv_max_m
                    cfg = None if gemv else (w4_best or {}).get((v, k, n, m))
                    rows.append(guarded(bench_one, v, k, n, m, dev, reps, cfg))
                    if v.startswith("w4_"):
                        rows[-1]["config"] = w4_label(v[3:], k, n, m, gemv, cfg)
                    print(f"{v} {m}x{k}->{n}: {rows[-1]['us']:.1f} us {rows[-1].get('config', '')}", flush=True)
    return rows


def w4_label(fmt, k, n, m, gemv, cfg):
    """The kernel and config that w4a16_gemm ran (cfg: a swept tensor-core config, None: its own dispatch)."""
    if gemv:
        t = tuning.current()
        return "gemv", (t.w4_gemv_config if m == 1 else t.w4_gemv_config_m2)[fmt]
    if cfg is None and w4_small_m.takes(m, n, k, fmt):
        return "small_m", w4_small_m.choose_config(m, n, k, fmt)
    return cfg or w4a16.choose_config(m, n, k, fmt)


def guarded(fn, variant, k, n, m, *args):
    """A failing kernel is reported in its row (us = inf, with the error) and the sweep goes on."""
    try:
        return fn(variant, k, n, m, *args)
    except Exception as e:  # noqa: BLE001 - recorded in the report and printed, not swallowed
        traceback.print_exc()
        return {"variant": variant, "in": k, "out": n, "M": m, "us": float("inf"), "tflops": 0.0, "gbps": 0.0,
                "error": f"{type(e).__name__}: {e}"[:300]}


def print_report(report):
    print(f"\n{report['gpu']}, torch {report['torch']}, triton {report['triton']}, {report['date']}\n")
    print(table(report["rows"]))
    print("\nSpeedup over cuBLAS bf16 (higher is faster):\n")
    print(speedup_summary(report["rows"]))
    print("\n| op | M | Triton us | torch eager us |\n|---|---|---|---|")
    for r in report["elementwise"]:
        print(f"| {r['op']} | {r['M']} | {r['triton_us']:.1f} | {r['torch_eager_us']:.1f} |", flush=True)
    print("\nFP8 activation quantization, fused into the producer or in a separate kernel, against the baseline"
          " (producer in bf16, then _scaled_mm alone on an input quantized for free); ratio = baseline / path.\n")
    print("| in->out | M | producer | producer bf16 us | _scaled_mm alone us | baseline us | fused path us |"
          " ratio fused | unfused path us | ratio unfused |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in report["fp8_producers"]:
        print(f"| {r['in']}->{r['out']} | {r['M']} | {r['producer']} | {r['producer_bf16_us']:.1f} | "
              f"{r['scaled_mm_alone_us']:.1f} | {r['baseline_us']:.1f} | {r['fused_us']:.1f} | "
              f"{r['ratio_fused']:.2f} | {r['unfused_us']:.1f} | {r['ratio_unfused']:.2f} |", flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="lowbit bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="in x out, comma separated")
    p.add_argument("--m", default=",".join(map(str, MS)), help="batch rows M, comma separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=30, help="timed graph replays per measurement")
    p.add_argument("--check", action="store_true", help="first check every kernel against its reference")
    p.add_argument("--sweep", action="store_true", help="first sweep W4 tile configs, then time W4 with the winners")
    p.add_argument("--sweep-budget-s", type=float, default=240.0, help="stop the W4 sweep after this long")
    p.add_argument("--w4-stages", help="sweep only these num_stages (comma separated) at 64-wide decode tiles")
    p.add_argument("--int8-sweep", action="store_true", help="also sweep INT8 GEMM tiles at M=4096 (report only)")
    p.add_argument("--json", type=Path, help="write all numbers here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("lowbit bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    import triton
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv or sys.argv[1:]}
    ok = True
    if args.check:
        from lowbit.bench import kernels_check as check
        report["checks"] = check.run_checks(dev)
        print(check.format_checks(report["checks"]), flush=True)
        ok = all(r["ok"] for r in report["checks"])
    w4_best = {}
    if args.sweep:  # W4 tile configs; the winners are Tuning.w4_gemm_tuned
        w4_best = sweep_w4(shapes, ms, dev, max(5, args.reps // 2), print, time.time() + args.sweep_budget_s,
                           [int(v) for v in args.w4_stages.split(",")] if args.w4_stages else None)
        report["w4_best"] = {"|".join(map(str, k)): v for k, v in w4_best.items()}
    variants = [v for v in args.variants.split(",") if v]
    report["rows"] = bench_gemms(shapes, ms, variants, dev, args.reps, w4_best)
    report["elementwise"] = bench_elementwise(dev, args.reps)
    report["fp8_producers"] = bench_fp8_producers(shapes, ms, dev, args.reps)
    if args.int8_sweep:
        report["int8_best"] = {f"{k}x{n}": v for (k, n), v in sweep_int8(shapes, dev, args.reps, print).items()}
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
