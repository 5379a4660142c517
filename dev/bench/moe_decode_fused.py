"""The MoE decode path's fused GEMVs (dev/bench/moe_fused_gemv.py, an experiment: SiLU-and-mul in the gate/up GEMV,
the top-k combine in the down GEMV) against the unfused per-pair GEMVs (moe.gemv, the activation kernel, the combine) at
Qwen3-30B-A3B's expert shapes, bf16 and fp8 experts, 1-16 tokens; and the router's top-k kernel against torch's
softmax / topk / renormalize chain (ids compared up to the order of tied probabilities).

    python3 dev/bench/moe_decode_fused.py [--formats bf16 fp8] [--tokens 1 2 4 8 16]
    TRITON_INTERPRET=1 python3 dev/bench/moe_decode_fused.py --tiny      # CPU: tiny shapes, checks only

Every variant is checked against fused_moe_ref (as moe_gemv_sweep.py checks) before it is timed; a failure prints
FAIL and the script exits 1. Tiles: the gate/up kernel's are swept with the down kernel at its default, then the
down kernel's with the best gate/up tiles (least time summed over the token counts).
"""
import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import moe_gemv_sweep as sweep  # noqa: E402
from moe_fused_gemv import down_combine_gemv, gated_gemv  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from lowbit.kernels.moe.route import moe_route_ref, moe_route_triton  # noqa: E402

DEFAULT = ((16, 256, 4), (16, 256, 4))
GATED = ((16, 256, 4), (8, 256, 2), (8, 512, 4), (16, 128, 4), (32, 128, 4), (4, 512, 2), (8, 1024, 4),
         (16, 512, 8))
DOWN = ((16, 256, 4), (8, 256, 2), (8, 256, 4), (4, 256, 2), (4, 512, 2), (16, 128, 4), (32, 128, 4), (8, 128, 2),
        (4, 128, 1), (2, 256, 1))


def run_fused(calls: list, refs: list, by_norm: bool, tol: float, reps: int):
    """(largest error, us per call or None when over tol)."""
    err = max(sweep.rel_err(call().float(), ref, by_norm) for call, ref in zip(calls, refs))
    return err, (sweep.time_layer(calls, reps) if err <= tol else None)


def fused(x, w13, w2, ids, weights, scales: dict, tiles):
    """The experiment's two launches; scales: fused_moe's keyword (fp8=Fp8Scales) or none."""
    fp8 = scales.get("fp8")
    s13, s2 = ((fp8.w13_scale, fp8.a13_scale), (fp8.w2_scale, fp8.a2_scale)) if fp8 else ((None, None), (None, None))
    return down_combine_gemv(gated_gemv(x, w13, ids, *s13, tiles[0]), w2, ids, weights, *s2, tiles[1])


def bench_format(fmt: str, args, s: dict, device, gen) -> bool:
    """-> every check passed."""
    w13, w2, scales = sweep.experts(fmt, s, device, gen)
    ok = True
    by_norm = fmt == "fp8" and interpreting()
    tol = sweep.INTERP_FP8_TOL if by_norm else sweep.REL_TOL
    cases, refs, unfused = {}, {}, {}
    for t in args.tokens:
        cases[t] = sweep.routings(t, s, w13.dtype if fmt == "bf16" else args.x_dtype, device, gen)
        refs[t] = [fused_moe_ref(x, w13, w2, ids, wts, **scales).float() for x, ids, wts in cases[t]]
        calls = [lambda c=c: fused_moe_triton(c[0], w13, w2, c[1], c[2], path="moe_gemv", **scales)
                 for c in cases[t]]
        err = max(sweep.rel_err(call().float(), ref, by_norm) for call, ref in zip(calls, refs[t]))
        unfused[t] = sweep.time_layer(calls, args.reps)
        print(f"{fmt:5s} {t:2d} tok  unfused moe_gemv {unfused[t]:9.1f} us  err {err:.1e}", flush=True)
        ok &= err <= tol

    def measure(tiles) -> dict | None:
        times = {}
        for t in args.tokens:
            calls = [lambda c=c: fused(c[0], w13, w2, c[1], c[2], scales, tiles) for c in cases[t]]
            err, us = run_fused(calls, refs[t], by_norm, tol, args.reps)
            if us is None:
                print(f"{fmt:5s} {t:2d} tok  fused {str(tiles):32s} FAIL max rel err {err:.1e} > {tol}", flush=True)
                return None
            times[t] = us
            print(f"{fmt:5s} {t:2d} tok  fused {str(tiles):32s} {us:9.1f} us  {unfused[t] / us:5.2f}x unfused  "
                  f"err {err:.1e}", flush=True)
        return times

    best, best_times = None, None
    for stage, variants in (("gated", [(g, DEFAULT[1]) for g in GATED]), ("down", None)):
        if variants is None:
            variants = [(best[0], d) for d in DOWN]
        for tiles in variants:
            times = measure(tiles)
            if times is None:
                ok = False
            elif best_times is None or sum(times.values()) < sum(best_times.values()):
                best, best_times = tiles, times
    max_tokens = 0
    for t in sorted(args.tokens):
        if best_times is None or best_times[t] > unfused[t]:
            break
        max_tokens = t
    if best_times and device == "cuda":
        each = ", ".join(f"{t} tok {best_times[t]:.1f} us ({unfused[t] / best_times[t]:.2f}x)" for t in args.tokens)
        print(f"# {fmt}: best tiles {best}: {each}; fused up to {max_tokens} tokens "
              f"({max_tokens * s['top_k']} pairs)", flush=True)
    return ok


def same_up_to_ties(logits, top_k: int) -> bool:
    """The kernel picks the reference's experts, in its order up to ties: each slot's probability equals the
    reference's weight there (bf16 logits tie often)."""
    weights, ids = moe_route_triton(logits, top_k, True)
    want, _ = moe_route_ref(logits, top_k, True)
    probs = torch.softmax(logits.float(), -1)
    ref_probs, _ = torch.topk(probs, top_k, -1)
    return bool(torch.equal(probs.gather(1, ids), ref_probs)) and torch.allclose(weights, want, atol=1e-6, rtol=1e-5)


def bench_route(args, s: dict, device, gen) -> bool:
    """The router's top-k kernel vs torch's chain, renormalized (Qwen3-30B-A3B's norm_topk_prob), bf16 logits."""
    ok = True
    for t in args.tokens:
        logits = [torch.randn(t, s["experts"], device=device, generator=gen).to(args.x_dtype) for _ in range(8)]
        same = all(same_up_to_ties(x, s["top_k"]) for x in logits)
        ok &= same
        kern = sweep.time_layer([lambda x=x: moe_route_triton(x, s["top_k"], True) for x in logits], args.reps)
        ref = sweep.time_layer([lambda x=x: moe_route_ref(x, s["top_k"], True) for x in logits], args.reps)
        print(f"route {t:2d} tok  kernel {kern:7.1f} us  torch {ref:7.1f} us  same experts {same}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.tiny != (not torch.cuda.is_available()) or (args.tiny and not interpreting()):
        raise SystemExit("moe_decode_fused: --tiny runs on the CPU under TRITON_INTERPRET=1; without it a CUDA GPU")
    s, device = (sweep.TINY, "cpu") if args.tiny else (sweep.FULL, "cuda")
    if args.tiny:
        global GATED, DOWN
        GATED, DOWN = GATED[:2], DOWN[:2]
    args.x_dtype = torch.float16 if args.tiny else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    where = "CPU interpreter" if args.tiny else torch.cuda.get_device_name()
    print(f"# moe_decode_fused {where} {datetime.date.today()} torch {torch.__version__}; H={s['hidden']} "
          f"I={s['inter']} E={s['experts']} top-{s['top_k']}; tiles (BLOCK_N, BLOCK_K, warps) of (gate/up, down)",
          flush=True)
    ok = bench_route(args, s, device, gen)
    for fmt in args.formats:
        ok &= bench_format(fmt, args, s, device, gen)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
