"""FP8 small-M GEMM (lowbit.kernels.linear.fp8_small_m) on the GPU: check against the reference, then time it against
cuBLAS bf16, per-tensor `torch._scaled_mm` and the routes w8a8 took before it, on the Llama-3.1-8B linear shapes.

Times are dev/bench/kernels.py's `time_us` (median of CUDA-graph replays over weight copies beyond L2).
`python3 dev/bench/fp8_small_m.py [--sweep] [--ladder] [--json FILE] [--budget-s S]`
- always: correctness checks on fresh random inputs (exit 1 on the first failure), incl. CUDA-graph replays
  (the split-K counters must reset) and bitwise repeatability;
- --sweep: configs (BLOCK_N, BLOCK_K, PROGRAMS, num_warps, num_stages) at M = 1 and 16 per shape;
- --ladder: M = 1..32 with the default config (and the sweep's best, if swept) against the old routes (the dispatch
  cut), and per-token x scales (FP8_PER_CHANNEL_PER_TOKEN) against cuBLAS row-wise.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lab import load_script
from lowbit.kernels.linear import fp8_small_m as fsm
from lowbit.kernels.linear import w8a8
from lowbit.kernels.linear.scaled_gemm import scaled_gemm_ref

SHAPES = {"qkv": (4096, 6144, True), "o": (4096, 4096, False), "gate_up": (4096, 28672, True),
          "down": (14336, 4096, False)}  # name: (in K, out N, per-row weight scales)
LADDER_M = (1, 2, 4, 8, 16, 24, 32)
SMEM_BYTES = 220 * 1024
DEV = "cuda"


def fp8(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-448, 448).to(torch.float8_e4m3fn)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_case(m, k, n, sa_per_token, sb_per_row, bias):
    dev = DEV
    q = fp8(torch.randn(m, k, device=dev) * 40)
    w = fp8(torch.randn(n, k, device=dev) * 100)
    sa = torch.rand(m, 1, device=dev) * 0.02 + 1e-3 if sa_per_token else torch.tensor(0.01, device=dev)
    sb = torch.rand(n, device=dev) * 4e-4 + 1e-5 if sb_per_row else torch.tensor(2e-4, device=dev)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    return q, w, sa, sb, b


# ---- correctness
CHECKS = [  # (M, K, N, per-token x scale, per-row w scale, bias, config or None)
    (1, 4096, 4096, False, False, False, None), (16, 4096, 6144, False, True, False, None),
    (1, 4096, 28672, False, True, False, None), (8, 14336, 4096, False, False, True, None),
    (32, 4096, 4096, True, True, False, None), (3, 200, 72, False, True, True, None),
    (17, 1000, 1030, False, False, False, None), (1, 4096, 4096, True, True, True, None),
    (16, 4096, 4096, False, False, False, (64, 256, 0, 4, 4)),
    (5, 4096, 6144, False, True, True, (128, 128, 100, 4, 3)),
    (2, 4096, 28672, True, True, True, (128, 256, 132, 4, 6)),
    (24, 14336, 4096, False, False, True, (64, 128, 264, 4, 6)),
    (1, 4096, 6144, False, True, False, (64, 256, 61, 4, 6)),  # programs spanning several tiles
]
TOL = 1e-2


def check_case(m, k, n, sa_tok, sb_row, bias, config) -> dict:
    q, w, sa, sb, b = random_case(m, k, n, sa_tok, sb_row, bias)
    out = fsm.fp8_small_m_gemm(q, w, sa, sb, b, torch.bfloat16, config)
    again = fsm.fp8_small_m_gemm(q, w, sa, sb, b, torch.bfloat16, config)
    ref = scaled_gemm_ref(q, w, sa, sb, b, torch.bfloat16)
    err = rel_err(out, ref)
    return {"check": f"M={m} {k}->{n} sa_tok={sa_tok} sb_row={sb_row} bias={bias} cfg={config}", "err": err,
            "ok": bool(torch.isfinite(out).all()) and err < TOL and torch.equal(out, again)}


def check_graph_replays(m, k, n, sb_row) -> dict:
    """The split-K counters reset at every launch: graph replays on new x stay correct."""
    q, w, sa, sb, _ = random_case(m, k, n, False, sb_row, False)
    fsm.fp8_small_m_gemm(q, w, sa, sb)  # workspace sized outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fsm.fp8_small_m_gemm(q, w, sa, sb)
    errs = []
    for _ in range(3):
        q.copy_(fp8(torch.randn(m, k, device=DEV) * 40))
        graph.replay()
        errs.append(rel_err(out, scaled_gemm_ref(q, w, sa, sb)))
    return {"check": f"graph replays M={m} {k}->{n}", "err": max(errs), "ok": max(errs) < TOL}


def run_checks() -> list[dict]:
    rows = [check_case(*c) for c in CHECKS]
    rows += [check_graph_replays(1, 4096, 4096, False), check_graph_replays(16, 14336, 4096, True)]
    counters = next(iter(fsm._WORKSPACE.values()))["counters"]  # one device
    rows.append({"check": "counters all zero after the checks", "err": float(counters.abs().sum()),
                 "ok": int(counters.abs().sum()) == 0})
    return rows


# ---- timing
class Shape:
    """Weight copies beyond L2 for one shape (fp8 + bf16), inputs per M built on demand."""

    def __init__(self, kb, k, n, per_row):
        self.kb, self.k, self.n, self.per_row = kb, k, n, per_row
        self.weights = [fp8(torch.randn(n, k, device=DEV) * 100) for _ in range(kb.copies_for(n * k))]
        self.sb = torch.rand(n, device=DEV) * 4e-4 + 1e-5 if per_row else torch.tensor(2e-4, device=DEV)

    def time(self, op, reps) -> float:
        calls = [lambda w=w: op(w) for w in self.weights]
        return self.kb.time_us(calls * -(-16 // len(calls)), reps)


def baselines(shape: Shape, m: int, reps: int) -> dict:
    """cuBLAS bf16, per-tensor _scaled_mm and the route w8a8 took for this scale kind before fp8_small_m."""
    q = fp8(torch.randn(m, shape.k, device=DEV) * 40)
    sa, one = torch.tensor(0.01, device=DEV), torch.ones((), device=DEV)
    row = {"scaled_mm_us": shape.time(lambda w: torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=one,
                                                                  out_dtype=torch.bfloat16), reps)}
    if shape.per_row:
        row["old_route_us"] = shape.time(lambda w: w8a8._per_tensor_then_column_scale(
            q, w, sa, shape.sb, None, torch.bfloat16), reps)
    else:
        row["old_route_us"] = row["scaled_mm_us"]
    dense = [torch.randn(shape.n, shape.k, device=DEV, dtype=torch.bfloat16)
             for _ in range(shape.kb.copies_for(2 * shape.n * shape.k))]
    xb = torch.randn(m, shape.k, device=DEV, dtype=torch.bfloat16)
    calls = [lambda w=w: F.linear(xb, w) for w in dense]
    row["bf16_us"] = shape.kb.time_us(calls * -(-16 // len(calls)), reps)
    del dense
    return row


def time_kernel(shape: Shape, m: int, config, reps: int, sa_per_token=False) -> float:
    q = fp8(torch.randn(m, shape.k, device=DEV) * 40)
    sa = torch.rand(m, 1, device=DEV) * 0.02 if sa_per_token else torch.tensor(0.01, device=DEV)
    return shape.time(lambda w: fsm.fp8_small_m_gemm(q, w, sa, shape.sb, None, torch.bfloat16, config), reps)


def sweep_configs(k, n, m, sms=132):
    m_pad = max(16, 1 << (m - 1).bit_length())
    for bn, bk, programs in itertools.product((64, 128), (128, 256), (0, sms, 2 * sms, 3 * sms)):
        for stages, warps in itertools.product((4, 6) if bk == 256 else (6, 10), (4, 8) if bn == 128 else (4,)):
            if stages * (bn * bk + bk * m_pad) <= SMEM_BYTES:
                yield bn, bk, programs, warps, stages


def tbps(shape: Shape, us: float) -> float:
    return shape.n * shape.k / us / 1e6


def sweep(kb, reps, deadline, emit) -> list[dict]:
    rows = []
    for name, (k, n, per_row) in SHAPES.items():
        shape = Shape(kb, k, n, per_row)
        for m in (1, 16):
            base = baselines(shape, m, reps)
            best = None
            for cfg in sweep_configs(k, n, m):
                if time.time() > deadline:
                    break
                try:
                    us = time_kernel(shape, m, cfg, reps)
                except Exception as e:  # noqa: BLE001 - a config that does not build is reported, the sweep goes on
                    emit({"sweep": name, "M": m, "config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                best = min(best or (us, cfg), (us, cfg))
                emit({"sweep": name, "M": m, "config": cfg, "us": us, "tbps": tbps(shape, us)})
            default = fsm.choose_config(m, n, k, fsm.sm_count(torch.device(DEV, 0)))
            us_default = time_kernel(shape, m, default, reps)
            best = best or (us_default, default)
            row = {"shape": name, "K": k, "N": n, "M": m, **base, "default": default, "default_us": us_default,
                   "best": best[1], "best_us": best[0]}
            rows.append(row)
            emit(row)
        del shape
        torch.cuda.empty_cache()
    return rows


def ladder(kb, reps, deadline, emit, best=None) -> list[dict]:
    """best: {(shape, 1 or 16): config} from a sweep; M = 1 takes the M = 1 winner, M > 1 the M = 16 one."""
    rows = []
    for name, (k, n, per_row) in SHAPES.items():
        shape = Shape(kb, k, n, per_row)
        for m in LADDER_M:
            if time.time() > deadline:
                break
            config = fsm.choose_config(m, n, k, fsm.sm_count(torch.device(DEV, 0)))
            us = time_kernel(shape, m, None, reps)
            row = {"ladder": name, "M": m, "config": config, "us": us, "tbps": tbps(shape, us),
                   **baselines(shape, m, reps)}
            swept = (best or {}).get((name, 1 if m == 1 else 16))
            if swept:
                row["swept_config"], row["swept_us"] = swept, time_kernel(shape, m, swept, reps)
            if m in (1, 16, 32):  # FP8_PER_CHANNEL_PER_TOKEN: per-token x scales, per-channel w scales
                row["per_token_us"] = time_kernel(shape, m, None, reps, sa_per_token=True)
                q = fp8(torch.randn(m, k, device=DEV) * 40)
                sa, sb = torch.rand(m, 1, device=DEV) * 0.02, torch.rand(1, n, device=DEV) * 4e-4
                row["rowwise_scaled_mm_us"] = shape.time(lambda w: torch._scaled_mm(
                    q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), reps)
            rows.append(row)
            emit(row)
        del shape
        torch.cuda.empty_cache()
    return rows


def print_summary(report):
    for r in report.get("sweep", []):
        print(f"sweep {r['shape']} M={r['M']}: best {r['best']} {r['best_us']:.2f} us, default {r['default']} "
              f"{r['default_us']:.2f}, scaled_mm {r['scaled_mm_us']:.2f}, old {r['old_route_us']:.2f}, "
              f"bf16 {r['bf16_us']:.2f}")
    for r in report.get("ladder", []):
        extra = (f", per-token {r['per_token_us']:.2f} vs rowwise {r['rowwise_scaled_mm_us']:.2f}"
                 if "per_token_us" in r else "")
        swept = f", swept {r['swept_config']} {r['swept_us']:.2f}" if "swept_us" in r else ""
        print(f"ladder {r['ladder']} M={r['M']}: {r['us']:.2f} us ({r['tbps']:.2f} TB/s), old {r['old_route_us']:.2f}, "
              f"scaled_mm {r['scaled_mm_us']:.2f}, bf16 {r['bf16_us']:.2f}{extra}{swept}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--ladder", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sweep-budget-s", type=float, default=150.0, help="stop the sweep this long after the start")
    p.add_argument("--budget-s", type=float, default=230.0, help="stop timing this long after the start")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    start = time.time()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv or sys.argv[1:]}
    report["checks"] = run_checks()
    for r in report["checks"]:
        print(f"{'ok ' if r['ok'] else 'FAIL'} {r['err']:.2e} {r['check']}", flush=True)
    if not all(r["ok"] for r in report["checks"]):
        print("fp8_small_m: CHECK FAILED, no timing", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))
        return 1
    kb, deadline = load_script("kernels.py"), start + args.budget_s

    def emit(row):
        print(json.dumps(row, default=str), flush=True)

    best = None
    if args.sweep:
        report["sweep"] = sweep(kb, args.reps, start + args.sweep_budget_s, emit)
        best = {(r["shape"], r["M"]): r["best"] for r in report["sweep"] if r["best"]}
    if args.ladder:
        report["ladder"] = ladder(kb, args.reps, deadline, emit, best)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print_summary(report)
    print(f"total {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
