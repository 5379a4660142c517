"""SiLU-and-mul tiles on the GPU: (BLOCK columns per program, warps) at Llama-3.1-8B's gate/up width, bf16 in,
FP8 out (the engine's static FP8 path) and bf16 out. Each config is checked against silu_and_mul_ref first
(FP8: codes equal except for rare one-code rounding ties; bf16: max rel. error 1e-2), then timed: median us of
`triton.testing.do_bench` and GB/s of (input + output) bytes.

`python3 dev/bench/silu_tiles.py [--m 1,1024,8192] [--json FILE]`
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton

from lowbit.bench_cli import int_list
from lowbit.kernels.ops import activation

CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 2), (1024, 2))
D = 14336


def check(x, scale, up_scale, config) -> None:
    ref = activation.silu_and_mul_ref(x, scale, up_scale)
    out = activation.silu_and_mul_triton(x, scale, up_scale, config=config)
    if scale is None:
        err = ((out.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-3)).max().item()
        assert err < 1e-2, (config, err)
    else:
        diff = (out.view(torch.uint8).int() - ref.view(torch.uint8).int()).abs()
        assert (diff > 1).sum().item() == 0 and (diff == 1).float().mean().item() < 1e-3, config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1,1024,8192")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{Path(__file__).name} needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = int_list(p, "--m", args.m)
    rows = []
    print("| M | out | " + " | ".join(f"{b}x{w}w" for b, w in CONFIGS) + " |")
    print("|---|---|" + "---|" * len(CONFIGS))
    for m in ms:
        x = torch.randn(m, 2 * D, device="cuda", dtype=torch.bfloat16) * 3
        up_scale = torch.tensor(0.9, device="cuda")
        for scale in (torch.tensor(0.05, device="cuda"), None):
            out_bytes = m * D * (1 if scale is not None else 2)
            cells = []
            for config in CONFIGS:
                check(x, scale, up_scale, config)
                us = triton.testing.do_bench(
                    lambda: activation.silu_and_mul_triton(x, scale, up_scale, config=config), return_mode="median") * 1e3
                rows.append({"M": m, "fp8_out": scale is not None, "config": config, "us": us,
                             "GBps": (x.numel() * 2 + out_bytes) / us / 1e3})
                cells.append(f"{us:.1f} ({rows[-1]['GBps']:.0f})")
            print(f"| {m} | {'fp8' if scale is not None else 'bf16'} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
