"""One kernel at one shape, launched a few times, for Nsight Compute to profile (GPU). The shapes are the ones the
serving figures hinge on: FP8-KV decode attention against bf16-KV (1000/1000's steps), the W4 GEMV and the FP8
small-M GEMM at batch 1 (Llama-3.1-8B's up projection: K 4096 -> N 28672), and the W4 tensor-core kernel at --rows
(w4tc: the same projection, as w4a16_gemm configures it); beside the W4 GEMV, the one-row GEMVs of the same structure
on 8- and 16-bit weights (int8: int8_gemv, bf16: dense_gemv) on that projection. Run it under ncu, e.g.

  ncu --clock-control none --set full -k regex:_decode_kernel -c 1 -o decode_fp8 \\
      python3 dev/bench/ncu_targets.py decode --kv fp8 --shape 512x1500
  ncu --import decode_fp8.ncu-rep --page details

`python3 dev/bench/ncu_targets.py decode|w4|w4tc|fp8|int8|bf16 [--kv fp8|bf16] [--shape BxCTX] [--fmt int4|nvfp4] [--rows M]
[--launches N]`
Without ncu it prints the mean time per launch (CUDA events), so the target can be checked on its own.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench_cli import int_pairs  # noqa: E402
from lab import load_script  # noqa: E402

UP_K, UP_N = 4096, 28672  # Llama-3.1-8B's gate/up projection, the largest batch-1 GEMM


def decode_target(kv: str, batch: int, ctx: int):
    from lowbit.kernels.attention import paged_attention as pa

    at = load_script("attention_tiles.py")
    cache, tables, lens = at.paged_cache(torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16, batch, ctx)
    q = torch.randn(batch, at.HQ, at.D, device="cuda", dtype=torch.bfloat16)
    return lambda: pa.paged_decode(q, cache, tables, lens, at.D ** -0.5, 0.05, 0.05)


def w4_target(fmt: str):
    wb = load_script("w4_gemv_bench.py")
    w = wb.random_weight(fmt, UP_K, UP_N, dev="cuda")
    x = torch.randn(1, UP_K, device="cuda", dtype=torch.bfloat16)
    return lambda: wb.gemv(x, w)


def w4_tensor_core_target(fmt: str, rows: int):
    from lowbit.kernels.linear import w4a16

    w = load_script("w4_gemv_bench.py").random_weight(fmt, UP_K, UP_N, dev="cuda")
    x = torch.randn(rows, UP_K, device="cuda", dtype=torch.bfloat16)
    return lambda: w4a16.tensor_core_gemm(x, w)


def int8_gemv_target():
    from lowbit.kernels.linear.int8_gemv import int8_gemv

    q = torch.randint(-127, 128, (1, UP_K), device="cuda", dtype=torch.int8)
    w = torch.randint(-127, 128, (UP_N, UP_K), device="cuda", dtype=torch.int8)
    sa, sb = torch.tensor(0.01, device="cuda"), torch.rand(UP_N, device="cuda") * 1e-3
    return lambda: int8_gemv(q, w, sa, sb)


def bf16_gemv_target():
    from lowbit.kernels.linear.dense_gemv import dense_gemv

    x = torch.randn(1, UP_K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(UP_N, UP_K, device="cuda", dtype=torch.bfloat16) * 0.02
    return lambda: dense_gemv(x, w)


def fp8_target():
    from lowbit.kernels.linear.fp8_small_m import fp8_small_m_gemm

    x = torch.randn(1, UP_K, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(UP_N, UP_K, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    return lambda: fp8_small_m_gemm(x, w, one, one)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=["decode", "w4", "w4tc", "fp8", "int8", "bf16"])
    p.add_argument("--kv", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--shape", default="512x1500", help="decode: BATCHxCONTEXT")
    p.add_argument("--fmt", choices=["int4", "nvfp4"], default="int4")
    p.add_argument("--rows", type=int, default=64, help="w4tc: rows of x")
    p.add_argument("--launches", type=int, default=5)
    a = p.parse_args(argv)
    if a.rows < 1:
        p.error(f"--rows {a.rows}: must be at least 1")
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    (batch, ctx), = int_pairs(p, "--shape", a.shape)
    fn = {"decode": lambda: decode_target(a.kv, batch, ctx), "w4": lambda: w4_target(a.fmt),
          "w4tc": lambda: w4_tensor_core_target(a.fmt, a.rows), "fp8": fp8_target, "int8": int8_gemv_target,
          "bf16": bf16_gemv_target}[a.target]()
    fn()  # compiles
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.launches):
        fn()
    end.record()
    torch.cuda.synchronize()
    print(f"{a.target}: {1e3 * start.elapsed_time(end) / a.launches:.1f} us per launch (mean of {a.launches})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
