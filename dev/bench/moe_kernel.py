"""Fused MoE (lowbit.kernels.fused_moe) against a per-expert loop of dense GEMMs at Qwen3-30B-A3B's expert shapes
(hidden 2048, moe_intermediate 768, 128 experts, top-8), bf16 or FP8 experts (--fp8: per-tensor weight scales, each
expert its own input scale), after checking the kernel against its reference. With --fp8 the "per-expert loop" is
the torch reference (each expert's weights dequantized to fp32 per call), not a loop of FP8 GEMMs.

    python3 dev/bench/moe_kernel.py [--batches 1 16 64 256] [--iters 50] [--fp8]

Prints one line per batch: microseconds per MoE layer for both, the speed-up, and the weight bytes the batch's
routed experts read over the fused time (GB/s). Random uniform routing; needs a CUDA GPU with Triton.
"""
import argparse
import datetime
import time

import torch

from lowbit.kernels.moe.fused_moe import Fp8Scales, fused_moe_ref, fused_moe_triton

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
REL_TOL = 2e-2  # bf16: each GEMM and the activation round to bf16 once; relative to the output's largest magnitude


def problem(t: int, gen: torch.Generator):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(t, HIDDEN, device=dev, generator=gen).to(dt)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=gen) / HIDDEN ** 0.5).to(dt)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=gen) / INTER ** 0.5).to(dt)
    logits = torch.randn(t, EXPERTS, device=dev, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, -1)
    return x, w13, w2, ids, weights / weights.sum(-1, keepdim=True)


def to_fp8(w13, w2, gen):
    """bf16 experts -> float8_e4m3fn with one weight scale per expert and projection (amax / 448), and input scales
    that differ by expert (amax 2..6 for x, 0.5..1.5 for the activation), as Fp8Scales."""
    def q(w):
        s = w.float().abs().amax(dim=(1, 2)) / 448
        return (w.float() / s[:, None, None]).to(torch.float8_e4m3fn), s[:, None].expand(-1, w.shape[1]).contiguous()

    (q13, s13), (q2, s2) = q(w13), q(w2)
    spread = torch.rand(EXPERTS, device="cuda", generator=gen)
    return q13, q2, Fp8Scales(s13, (2 + 4 * spread) / 448, s2, (0.5 + spread) / 448)


def time_us(fn, iters: int) -> float:
    """Median microseconds of fn over iters runs (each timed with CUDA events), after 3 warm-up runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--fp8", action="store_true", help="FP8 experts (per-tensor scales, per-expert input scales)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} {datetime.date.today()} torch {torch.__version__}; "
          f"H={HIDDEN} I={INTER} E={EXPERTS} top-{TOP_K} {'fp8' if args.fp8 else 'bf16'} experts")
    for t in args.batches:
        x, w13, w2, ids, weights = problem(t, gen)
        fp8 = None
        if args.fp8:
            w13, w2, fp8 = to_fp8(w13, w2, gen)
        out, ref = fused_moe_triton(x, w13, w2, ids, weights, fp8=fp8), fused_moe_ref(x, w13, w2, ids, weights, fp8=fp8)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if not err <= REL_TOL:
            raise SystemExit(f"batch {t}: fused vs reference max error {err:.3g} of the largest output > {REL_TOL}")
        fused = time_us(lambda: fused_moe_triton(x, w13, w2, ids, weights, fp8=fp8), args.iters)
        loop = time_us(lambda: fused_moe_ref(x, w13, w2, ids, weights, fp8=fp8), args.iters)
        active = torch.unique(ids).numel()
        gbs = active * 3 * INTER * HIDDEN * w13.element_size() / (fused * 1e-6) / 1e9
        print(f"batch {t:4d}: fused {fused:9.1f} us  per-expert loop {loop:9.1f} us  x{loop / fused:5.2f}  "
              f"({active} experts, {gbs:7.1f} GB/s of expert weights)  max rel err {err:.2e}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# {time.time() - t0:.1f} s")
