"""The batch-1 bf16 layer chain with and without its RMSNorms (and SiLU) folded into the GEMVs (GPU, Llama-8B shapes).

Unfused (the engine's today): norm -> qkv GEMV -> o GEMV -> norm -> gate/up GEMV -> SiLU -> down GEMV per layer, the
norms as their own kernels (residual add inside). Fused: o and down add the residual in their epilogue and add the
new residual's sum of squares into one fp32 per norm (an atomic per program); qkv and gate/up normalize x on load
from it (dense_gemv's norm= / residual=); a third chain also folds SiLU-and-mul into the gate/up GEMV (silu_mul=).
Attention is left out (o reads the q part of qkv), so the chains isolate the norms and SiLU. All run 32 layers from
the same input, are checked against the unfused one, then timed as CUDA-graph replays with every kernel launched
early (as the engine's batch 1-2 graphs) and with only the GEMVs early.
`python3 bench/fused_norm_bench.py [--layers 32]`
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.kernels import rms_norm, silu_and_mul  # noqa: E402
from lowbit.kernels._triton import all_kernels_early  # noqa: E402
from lowbit.kernels.dense_gemv import dense_gemv  # noqa: E402

HIDDEN, QKV, INTER, EPS = 4096, 6144, 14336, 1e-5
CHECK_TOL = 3e-2  # relative L2 difference of the final residual stream (bf16 roundings, atomic sum order)


def make_layers(n: int, device) -> list[dict]:
    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16)
    return [{"qkv": rand(QKV, HIDDEN), "o": rand(HIDDEN, HIDDEN), "gate_up": rand(2 * INTER, HIDDEN),
             "down": rand(HIDDEN, INTER), "norm1": 1 + rand(HIDDEN, scale=0.1), "norm2": 1 + rand(HIDDEN, scale=0.1)}
            for _ in range(n)]


def unfused(layers, x):
    """-> the residual stream after the layers (each norm its own kernel)."""
    residual = None
    for w in layers:
        h, residual = rms_norm(x, w["norm1"], EPS, residual)
        a = dense_gemv(h, w["qkv"])[:, :HIDDEN]
        h, residual = rms_norm(dense_gemv(a, w["o"]), w["norm2"], EPS, residual)
        x = dense_gemv(silu_and_mul(dense_gemv(h, w["gate_up"])), w["down"])
    return (x.float() + residual.float()).to(x.dtype)


def fused(layers, x, sums, silu: bool = False):
    """-> the same stream; sums: fp32 [2 * len(layers)], zeroed here (one memset per chain). silu: SiLU-and-mul
    folded into the gate/up GEMV too."""
    sums.zero_()
    h, residual = rms_norm(x, layers[0]["norm1"], EPS)  # the first input norm has no GEMV before it
    for i, w in enumerate(layers):
        ss_in, ss_mid = sums[2 * i - 1:2 * i], sums[2 * i:2 * i + 1]
        qkv = dense_gemv(h, w["qkv"]) if i == 0 else dense_gemv(residual, w["qkv"], norm=(ss_in, w["norm1"], EPS))
        residual = dense_gemv(qkv[:, :HIDDEN], w["o"], residual=(residual, ss_mid))
        if silu:
            act = dense_gemv(residual, w["gate_up"], norm=(ss_mid, w["norm2"], EPS), silu_mul=True)
        else:
            act = silu_and_mul(dense_gemv(residual, w["gate_up"], norm=(ss_mid, w["norm2"], EPS)))
        residual = dense_gemv(act, w["down"], residual=(residual, sums[2 * i + 1:2 * i + 2]))
    return residual


def replay_ms(fn, early: bool) -> float:
    import triton

    with all_kernels_early(early):
        fn()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error("--layers must be >= 2")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    layers = make_layers(args.layers, "cuda")
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    sums = torch.zeros(2 * args.layers, dtype=torch.float32, device="cuda")
    want = unfused(layers, x)
    for silu in (False, True):
        got = fused(layers, x, sums, silu)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"check: fused{' + silu' if silu else ''} vs unfused final residual, relative L2 {err:.2e} "
              f"(tolerance {CHECK_TOL:.0e})", flush=True)
        if not err < CHECK_TOL:
            print("FAIL", flush=True)
            return 1
    for early in (True, False):
        a = replay_ms(lambda: unfused(layers, x), early)
        b = replay_ms(lambda: fused(layers, x, sums), early)
        c = replay_ms(lambda: fused(layers, x, sums, True), early)
        print(f"{'every kernel early' if early else 'only GEMVs early'}: unfused {a:.4f} ms, norms fused {b:.4f} "
              f"({1e3 * (a - b) / args.layers:+.2f} us per layer saved), norms + silu fused {c:.4f} "
              f"({1e3 * (a - c) / args.layers:+.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
