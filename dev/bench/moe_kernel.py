"""Fused MoE (lowbit.kernels.fused_moe) against a per-expert loop of dense GEMMs at Qwen3-30B-A3B's expert shapes
(hidden 2048, moe_intermediate 768, 128 experts, top-8), bf16, after checking the kernel against its reference.

    python3 dev/bench/moe_kernel.py [--batches 1 16 64 256] [--iters 50]

Prints one line per batch: microseconds per MoE layer for both, the speed-up, and the weight bytes the batch's
routed experts read over the fused time (GB/s). Random uniform routing; needs a CUDA GPU with Triton.
"""
import argparse
import datetime
import time

import torch

from lowbit.kernels.moe.fused_moe import fused_moe_ref, fused_moe_triton

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
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} {datetime.date.today()} torch {torch.__version__}; "
          f"H={HIDDEN} I={INTER} E={EXPERTS} top-{TOP_K} bf16")
    for t in args.batches:
        x, w13, w2, ids, weights = problem(t, gen)
        out, ref = fused_moe_triton(x, w13, w2, ids, weights), fused_moe_ref(x, w13, w2, ids, weights)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if not err <= REL_TOL:
            raise SystemExit(f"batch {t}: fused vs reference max error {err:.3g} of the largest output > {REL_TOL}")
        fused = time_us(lambda: fused_moe_triton(x, w13, w2, ids, weights), args.iters)
        loop = time_us(lambda: fused_moe_ref(x, w13, w2, ids, weights), args.iters)
        active = torch.unique(ids).numel()
        gbs = active * 3 * INTER * HIDDEN * 2 / (fused * 1e-6) / 1e9
        print(f"batch {t:4d}: fused {fused:9.1f} us  per-expert loop {loop:9.1f} us  x{loop / fused:5.2f}  "
              f"({active} experts, {gbs:7.1f} GB/s of expert weights)  max rel err {err:.2e}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# {time.time() - t0:.1f} s")
