"""Fused MoE (lowbit.kernels.moe) against a per-expert loop of lowbit's own linear kernels at Qwen3-30B-A3B's expert
shapes (hidden 2048, moe_intermediate 768, 128 experts, top-8), for every expert format: bf16, fp8 (per-tensor
weight scales, each expert its own input scale), fp8_pt (per-channel weight scales, per-token activations:
fp8_dynamic), int8 (W8A8 SmoothQuant: per-channel int8 weights, each expert its own pre_quant_scale and static
input scale), int4 (W4A16 AWQ, group 128, each expert its own pre_quant_scale) and nvfp4 (W4A16 NVFP4: e2m1 codes,
e4m3 scales per 16, weight-only).

    python3 dev/bench/moe_kernel.py [--formats bf16 fp8 fp8_pt int8 int4 nvfp4] [--batches 1 2 4 8 16 64 256]
                                    [--iters 50]

Each (format, batch): the fused kernels first checked against fused_moe_ref (max error relative to the largest
output), then timed three ways: as routed (routes' op "moe" picks the GEMV or the grouped GEMM), both paths forced,
and the loop (pairs sorted by expert on the host, then per active expert kernels.linear on its prepared gate/up and
down, SiLU-and-mul, the combine). Prints microseconds per MoE layer, the loop / routed speed-up and the routed run's
GB/s of the routed experts' weight bytes. Random uniform routing; needs a CUDA GPU with Triton.
"""
import argparse
import datetime
import time

import torch

from lowbit import formats, kernels
from lowbit.kernels import routes, tuning
from lowbit.kernels.moe.fused_moe import (Fp8Scales, Int4Scales, Int8Scales, Nvfp4Scales, combine, fused_moe_ref,
                                          fused_moe_triton)
from lowbit.kernels.ops.activation import silu_and_mul

HIDDEN, INTER, EXPERTS, TOP_K, GROUP = 2048, 768, 128, 8, 128
REL_TOL = 2e-2  # bf16: each GEMM and the activation round to bf16 once; relative to the output's largest magnitude
# per-token FP8 re-quantizes the intermediate activation: one bf16 rounding apart moves a code (2.1 % seen at 1 token)
REL_TOL_PER_TOKEN = 4e-2
ALGO = {"bf16": None, "fp8": formats.FP8.name, "fp8_pt": formats.FP8_PER_CHANNEL_PER_TOKEN.name,
        "int8": formats.W8A8_SQ_PER_CHANNEL.name, "int4": formats.W4A16_AWQ.name, "nvfp4": formats.W4A16_NVFP4.name}
# int4: a nibble + an fp32 scale per group; nvfp4: a nibble + an e4m3 scale per 16
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0, "fp8_pt": 1.0, "int8": 1.0, "int4": 0.5 + 4 / GROUP, "nvfp4": 0.5 + 1 / 16}


def expert_tensors(fmt: str, gen: torch.Generator) -> list:
    """Per expert, on-disk tensors of (merged gate/up, down) in format fmt, quantized on the GPU from random weights;
    per-expert input scales (fp8, int8) and pre_quant_scales (int8, int4) that differ from expert to expert."""
    out = []
    for e in range(EXPERTS):
        w13 = torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN ** 0.5
        w2 = torch.randn(HIDDEN, INTER, device="cuda", generator=gen) / INTER ** 0.5
        if fmt == "bf16":
            out.append(({"weight": w13.bfloat16()}, {"weight": w2.bfloat16()}))
            continue
        f = formats.get(ALGO[fmt])
        spread = e / (EXPERTS - 1)
        smoothed = fmt in ("int4", "int8")
        smooth13 = 0.5 + torch.rand(HIDDEN, device="cuda", generator=gen) if smoothed else None
        smooth2 = 0.5 + torch.rand(INTER, device="cuda", generator=gen) if smoothed else None
        out.append((f.quantize(w13, group=GROUP, smooth=smooth13, x_amax=2 + 4 * spread),
                    f.quantize(w2, group=GROUP, smooth=smooth2, x_amax=0.5 + spread)))
    return out


def stacked(fmt: str, tensors: list):
    """(w13, w2, fp8, int4 or int8) as fused_moe takes them."""
    w13 = torch.stack([a["weight"] for a, _ in tensors])
    w2 = torch.stack([b["weight"] for _, b in tensors])
    if fmt == "fp8_pt":
        return w13, w2, Fp8Scales(torch.stack([a["weight_scale"].float() for a, _ in tensors]), None,
                                  torch.stack([b["weight_scale"].float() for _, b in tensors]), None), None
    if fmt == "fp8":
        rows = lambda t, n: t["weight_scale"].float().reshape(-1).expand(n)  # noqa: E731
        return w13, w2, Fp8Scales(torch.stack([rows(a, 2 * INTER) for a, _ in tensors]),
                                  torch.stack([a["input_scale"].float().reshape(()) for a, _ in tensors]),
                                  torch.stack([rows(b, HIDDEN) for _, b in tensors]),
                                  torch.stack([b["input_scale"].float().reshape(()) for _, b in tensors])), None
    if fmt == "int8":
        stack = lambda i, key: torch.stack([t[i][key].float().squeeze() for t in tensors])  # noqa: E731
        return w13, w2, None, Int8Scales(stack(0, "weight_scale"), stack(0, "input_scale"), stack(0, "pre_quant_scale"),
                                         stack(1, "weight_scale"), stack(1, "input_scale"), stack(1, "pre_quant_scale"))
    if fmt == "int4":
        return w13, w2, None, Int4Scales(*(torch.stack([t[i][key].float() for t in tensors])
                                           for i, key in ((0, "weight_scale"), (0, "pre_quant_scale"),
                                                          (1, "weight_scale"), (1, "pre_quant_scale"))))
    return w13, w2, None, None


def per_expert_loop(x, ids, weights, prepared):
    """The pairs sorted by expert (one host sync), each active expert's two linears on lowbit's own kernels."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=EXPERTS).tolist()
    rows = torch.empty(flat.numel(), HIDDEN, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            pairs = order[start:start + n]
            p13, p2 = prepared[e]
            rows[pairs] = kernels.linear(silu_and_mul(kernels.linear(x[pairs // k], p13)), p2)
            start += n
    return combine(rows, weights)


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


def nvfp4_scales(fmt: str, tensors: list) -> Nvfp4Scales | None:
    """NVFP4 experts' block scales and per-row global scales as MoeExperts stacks them (None for other formats)."""
    if fmt != "nvfp4":
        return None
    rows = lambda t: t["weight_scale_2"].float().reshape(1).expand(t["weight"].shape[0])  # noqa: E731
    return Nvfp4Scales(torch.stack([a["weight_scale"] for a, _ in tensors]), torch.stack([rows(a) for a, _ in tensors]),
                       torch.stack([b["weight_scale"] for _, b in tensors]), torch.stack([rows(b) for _, b in tensors]))


def run_format(fmt: str, args, gen) -> None:
    tensors = expert_tensors(fmt, gen)
    w13, w2, fp8, int4 = stacked(fmt, tensors)  # nvfp4: the stacked codes, no fp8 / int4 scales
    int8 = int4 if fmt == "int8" else None
    int4 = None if fmt == "int8" else int4
    nvfp4 = nvfp4_scales(fmt, tensors)
    on_gpu = lambda s: None if s is None else type(s)(*(None if v is None else v.cuda() for v in s))  # noqa: E731
    # the dummy quantizer leaves input scales on the host
    fp8, int4, nvfp4, int8 = on_gpu(fp8), on_gpu(int4), on_gpu(nvfp4), on_gpu(int8)
    algo = ALGO[fmt] or formats.BF16.name
    prepared = [(kernels.prepare_linear(algo, a, "cuda"), kernels.prepare_linear(algo, b, "cuda")) for a, b in tensors]
    del tensors
    for t in args.batches:
        x = torch.randn(t, HIDDEN, device="cuda", generator=gen).bfloat16()
        weights, ids = torch.topk(torch.softmax(torch.randn(t, EXPERTS, device="cuda", generator=gen), -1), TOP_K, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        fused = lambda path=None: fused_moe_triton(x, w13, w2, ids, weights, fp8=fp8, int4=int4, path=path,  # noqa
                                                   nvfp4=nvfp4, int8=int8)
        ref = fused_moe_ref(x, w13, w2, ids, weights, fp8=fp8, int4=int4, nvfp4=nvfp4, int8=int8).float()
        errs = {p: ((fused(p).float() - ref).abs().max() / ref.abs().max()).item() for p in ("moe_gemv", "moe_grouped")}
        tol = REL_TOL_PER_TOKEN if fmt == "fp8_pt" else REL_TOL
        if not max(errs.values()) <= tol:
            raise SystemExit(f"{fmt} batch {t}: fused vs reference max error {errs} > {tol}")
        kind = {"bf16": "dense", "fp8_pt": "fp8"}.get(fmt, fmt)
        picked = routes.route("moe", kind, t * TOP_K, 2 * INTER, HIDDEN,
                              torch.cuda.get_device_capability())
        us = {p: time_us(lambda: fused(p), args.iters) for p in ("moe_gemv", "moe_grouped")}
        loop = time_us(lambda: per_expert_loop(x, ids, weights, prepared), args.iters)
        active = torch.unique(ids).numel()
        gbs = active * 3 * INTER * HIDDEN * BYTES_PER_WEIGHT[fmt] / (us[picked] * 1e-6) / 1e9
        print(f"{fmt:4s} batch {t:4d}: routed {picked:11s} {us[picked]:8.1f} us | gemv {us['moe_gemv']:8.1f} "
              f"grouped {us['moe_grouped']:8.1f} | loop {loop:8.1f} us  x{loop / us[picked]:5.2f}  "
              f"({active} experts, {gbs:6.1f} GB/s)  max rel err {max(errs.values()):.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "fp8_pt", "int4"], choices=sorted(ALGO))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} {datetime.date.today()} torch {torch.__version__}; "
          f"H={HIDDEN} I={INTER} E={EXPERTS} top-{TOP_K}; moe_gemv up to "
          f"{dict(tuning.current().moe_gemv_max_pairs)} pairs")
    for fmt in args.formats:
        run_format(fmt, args, gen)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# {time.time() - t0:.1f} s")
