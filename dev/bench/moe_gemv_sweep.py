"""The fused MoE's decode GEMV (lowbit.kernels.moe.gemv) over tile variants at Qwen3-30B-A3B's expert shapes (hidden
2048, moe_intermediate 768, 128 experts, top-8): bf16, fp8 (per-tensor, each expert its own input scale), int8
(W8A8 SmoothQuant, each expert its own smoothing and input scale), int4 (W4A16 AWQ, group 128) and nvfp4 (weight-only,
e2m1 with e4m3 scales per 16) experts at 1, 2, 4 and 8 tokens.

    python3 dev/bench/moe_gemv_sweep.py [--formats bf16 fp8 int8 int4 nvfp4] [--tokens 1 2 4 8]
                                        [--variants "BN,BK,W,S;..."]
    TRITON_INTERPRET=1 python3 dev/bench/moe_gemv_sweep.py --tiny     # CPU: tiny shapes, fp16, checks only

A variant is Tuning.moe_gemv_config's tuple (BLOCK_N, BLOCK_K, num_warps, K splits). Each (format, tokens, variant):
the whole layer on the GEMV path (gate/up GEMV, SiLU-and-mul, down GEMV, combine) under tuning.override, checked
against fused_moe_ref (max error relative to the largest output) before it is timed; a variant that fails is printed
FAIL and not timed, and the script exits 1. Time: median per layer call of CUDA-graph replays, each replay running
CALLS layer calls on different random routings (the experts' weights stream from HBM, not L2). GB/s: the routed
experts' weight bytes (gate/up and down, scales included) per call over its time. The fastest variant per (format,
tokens) ends each block; per format, the variant with the least time summed over the token counts is printed as the
line to put in lowbit/kernels/tuning/sm90.py's moe_gemv_config.
"""
import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without pip install -e

from lowbit import formats  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.fused_moe import Fp8Scales, Int4Scales, Int8Scales, fused_moe_ref, fused_moe_triton  # noqa
from lowbit.kernels.moe.gemv import int4_block_k  # noqa: E402
from lowbit.kernels.moe.nvfp4 import Nvfp4Scales  # noqa: E402

FULL = dict(hidden=2048, inter=768, experts=128, top_k=8, group=128)
TINY = dict(hidden=128, inter=128, experts=4, top_k=2, group=128)
KIND = {"bf16": "dense", "fp8": "fp8", "int8": "int8", "int4": "int4", "nvfp4": "nvfp4"}
ALGO = {"fp8": formats.FP8, "int8": formats.W8A8_SQ_PER_CHANNEL, "int4": formats.W4A16_AWQ}
# int4: an fp32 scale per group of 128; nvfp4: an e4m3 scale per 16 (and an fp32 global scale per row, not counted)
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 128, "nvfp4": 0.5 + 1 / 16}
CALLS = 8  # layer calls per graph replay, each on its own routing (--tiny: 2)
REL_TOL = 2e-2  # bf16 / fp16: each GEMV and the activation round once; relative to the output's largest magnitude
# the interpreter's fp32 -> fp8 cast is wrong on a few % of values: there fp8 is compared by norm, as
# tests/test_kernels_moe_fp8 does (measured 0.10-0.15 of the output's norm)
INTERP_FP8_TOL = 0.2
# baseline first; narrow row blocks with long K steps (the dense GEMV's shape), wider warps, split K for more programs
VARIANTS = ((32, 128, 4, 1), (16, 256, 4, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (4, 1024, 4, 1), (4, 2048, 4, 1),
            (8, 1024, 8, 1), (16, 512, 8, 1), (64, 128, 4, 1), (8, 256, 2, 1), (32, 128, 4, 2), (32, 128, 4, 4),
            (16, 512, 4, 2), (8, 512, 4, 4))


def experts(fmt: str, s: dict, device, gen) -> tuple:
    """(w13, w2, fused_moe scale kwargs) of random experts in format fmt, quantized as lowbit's formats do, with
    input scales and smoothing that differ from expert to expert."""
    h, i, n = s["hidden"], s["inter"], s["experts"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    w13 = torch.randn(n, 2 * i, h, device=device, generator=gen) / h ** 0.5
    w2 = torch.randn(n, h, i, device=device, generator=gen) / i ** 0.5
    if fmt == "bf16":
        return w13.to(dtype), w2.to(dtype), {}
    if fmt == "nvfp4":
        return nvfp4_experts(w13, w2, s)
    f, parts = ALGO[fmt], []
    for e in range(n):
        spread = e / max(n - 1, 1)
        smooth = [0.5 + torch.rand(k, device=device, generator=gen) for k in (h, i)]
        parts.append([f.quantize(w[e], group=s["group"], smooth=m, x_amax=amax)
                      for w, m, amax in ((w13, smooth[0], 2 + 4 * spread), (w2, smooth[1], 0.5 + spread))])
    stack = lambda j, key, rows=None: torch.stack([  # noqa: E731  (rows: a per-tensor scale repeated per row)
        p[j][key].float().reshape(-1).expand(rows) if rows else p[j][key].float().squeeze() for p in parts]).to(device)
    weights = (torch.stack([p[0]["weight"] for p in parts]).to(device),
               torch.stack([p[1]["weight"] for p in parts]).to(device))
    if fmt == "fp8":
        scales = Fp8Scales(stack(0, "weight_scale", 2 * i), stack(0, "input_scale"), stack(1, "weight_scale", h),
                           stack(1, "input_scale"))
    elif fmt == "int8":
        scales = Int8Scales(stack(0, "weight_scale"), stack(0, "input_scale"), stack(0, "pre_quant_scale"),
                            stack(1, "weight_scale"), stack(1, "input_scale"), stack(1, "pre_quant_scale"))
    else:
        scales = Int4Scales(stack(0, "weight_scale").reshape(n, 2 * i, -1), stack(0, "pre_quant_scale"),
                            stack(1, "weight_scale").reshape(n, h, -1), stack(1, "pre_quant_scale"))
    return *weights, {fmt: scales}


def nvfp4_experts(w13: torch.Tensor, w2: torch.Tensor, s: dict) -> tuple:
    """NVFP4 experts (weight-only): gate, up and down of each expert quantized by W4A16_NVFP4 on their own (gate's
    and up's global scales differ), stacked as the loader stacks them."""
    f, i = formats.W4A16_NVFP4, s["inter"]
    parts = [(f.quantize(w13[e, :i]), f.quantize(w13[e, i:]), f.quantize(w2[e])) for e in range(s["experts"])]
    rows = lambda p: p["weight_scale_2"].float().reshape(1).expand(p["weight"].shape[0])  # noqa: E731
    scales = Nvfp4Scales(
        w13_block=torch.stack([torch.cat([g["weight_scale"], u["weight_scale"]]) for g, u, _ in parts]),
        w13_global=torch.stack([torch.cat([rows(g), rows(u)]) for g, u, _ in parts]),
        w2_block=torch.stack([d["weight_scale"] for _, _, d in parts]),
        w2_global=torch.stack([rows(d) for _, _, d in parts]))
    w13q = torch.stack([torch.cat([g["weight"], u["weight"]]) for g, u, _ in parts])
    return w13q, torch.stack([d["weight"] for _, _, d in parts]), {"nvfp4": scales}


def routings(t: int, s: dict, x_dtype, device, gen) -> list:
    """CALLS (x, topk_ids, topk_weights) with random softmax routing, renormalized (2 on the CPU)."""
    out = []
    for _ in range(CALLS if device == "cuda" else 2):
        x = torch.randn(t, s["hidden"], device=device, generator=gen).to(x_dtype)
        logits = torch.randn(t, s["experts"], device=device, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), s["top_k"], -1)
        out.append((x, ids, weights / weights.sum(-1, keepdim=True)))
    return out


def effective(fmt: str, variant: tuple, group: int) -> tuple:
    """The config the kernel runs (INT4 cuts BLOCK_K to divide the group)."""
    block_n, block_k, warps, split = variant
    return (block_n, int4_block_k(group, block_k), warps, split) if fmt == "int4" else variant


def rel_err(out: torch.Tensor, ref: torch.Tensor, by_norm: bool) -> float:
    """Largest error relative to the reference's largest magnitude (by_norm: ||out - ref|| / ||ref||)."""
    if by_norm:
        return ((out - ref).norm() / ref.norm()).item()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def layer_bytes(fmt: str, ids: torch.Tensor, s: dict) -> float:
    return torch.unique(ids).numel() * 3 * s["inter"] * s["hidden"] * BYTES_PER_WEIGHT[fmt]


def time_layer(calls: list, reps: int) -> float:
    """Median us per call: CUDA-graph replays of all calls (lowbit.bench.kernels.time_us); nan on the CPU (the
    interpreter's checks prove the variants run; its times mean nothing)."""
    if not torch.cuda.is_available():
        return float("nan")
    from lowbit.bench.kernels import time_us
    return time_us(calls, reps)


def check_and_time(kind: str, config: tuple, calls: list, refs: list, by_norm: bool, tol: float, reps: int):
    """With moe_gemv_config[kind] = config: (largest error of the calls against refs, us per call, or None when the
    error is over tol)."""
    with tuning.override(moe_gemv_config=tuning.frozen({**tuning.current().moe_gemv_config, kind: config})):
        err = max(rel_err(call().float(), ref, by_norm) for call, ref in zip(calls, refs))
        return err, (time_layer(calls, reps) if err <= tol else None)


def sweep(fmt: str, args, s: dict, device, gen) -> bool:
    """Prints one block per token count; -> every variant passed its check."""
    w13, w2, scales = experts(fmt, s, device, gen)
    kind, ok = KIND[fmt], True
    totals: dict = {}  # config -> us at each token count it passed
    for t in args.tokens:
        cases = routings(t, s, w13.dtype if fmt == "bf16" else args.x_dtype, device, gen)
        refs = [fused_moe_ref(x, w13, w2, ids, wts, **scales).float() for x, ids, wts in cases]
        gbytes = sum(layer_bytes(fmt, ids, s) for _, ids, _ in cases) / len(cases) / 1e9
        by_norm = fmt == "fp8" and interpreting()
        tol = INTERP_FP8_TOL if by_norm else REL_TOL
        results, seen = [], set()
        for variant in args.variants:
            config = effective(fmt, variant, s["group"])
            if config in seen:
                continue
            seen.add(config)
            calls = [lambda c=c: fused_moe_triton(c[0], w13, w2, c[1], c[2], path="moe_gemv", **scales)
                     for c in cases]
            err, us = check_and_time(kind, config, calls, refs, by_norm, tol, args.reps)
            if us is None:
                ok = False
                print(f"{fmt:5s} {t:2d} tok  {str(config):22s} FAIL max rel err {err:.1e} > {tol}", flush=True)
                continue
            results.append((us, config))
            totals.setdefault(config, []).append(us)
            print(f"{fmt:5s} {t:2d} tok  {str(config):22s} {us:9.1f} us {gbytes / (us * 1e-6):8.1f} GB/s  "
                  f"err {err:.1e}", flush=True)
        if results and device == "cuda":
            us, best = min(results)
            base = next((u for u, c in results if c == effective(fmt, args.variants[0], s["group"])), float("nan"))
            print(f"# best {fmt} {t} tok: {best} {us:.1f} us, {gbytes / (us * 1e-6):.1f} GB/s "
                  f"({base / us:.2f}x the first variant)", flush=True)
    every = {c: sum(us) for c, us in totals.items() if len(us) == len(args.tokens)}
    if every and device == "cuda":  # one config per kind: the least time summed over the token counts
        best = min(every, key=every.get)
        print(f"# {fmt} over {args.tokens} tokens: {best} sums {every[best]:.1f} us -> sm90.py moe_gemv_config"
              f"[{kind!r}] = {best}", flush=True)
    return ok


def parse_variants(text: str) -> tuple:
    return tuple(tuple(int(v) for v in item.split(",")) for item in text.split(";") if item.strip())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=list(KIND), choices=list(KIND))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--variants", type=parse_variants, default=VARIANTS, help='"BN,BK,W,S;..." (default: the sweep)')
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.tiny != (not torch.cuda.is_available()) or (args.tiny and not interpreting()):
        raise SystemExit("moe_gemv_sweep: --tiny runs on the CPU under TRITON_INTERPRET=1; without it a CUDA GPU")
    s, device = (TINY, "cpu") if args.tiny else (FULL, "cuda")
    args.x_dtype = torch.float16 if args.tiny else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    where = "CPU interpreter" if args.tiny else torch.cuda.get_device_name()
    print(f"# moe_gemv_sweep {where} {datetime.date.today()} torch {torch.__version__}; H={s['hidden']} "
          f"I={s['inter']} E={s['experts']} top-{s['top_k']}; config (BLOCK_N, BLOCK_K, warps, splits); "
          f"{CALLS if device == 'cuda' else 2} routings per replay", flush=True)
    t0 = time.time()
    ok = all([sweep(fmt, args, s, device, gen) for fmt in args.formats])
    print(f"# {time.time() - t0:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
