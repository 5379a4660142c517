"""FP8 merged q/k/v and gate/up GEMM options on the GPU: per-tensor FP8 activations times FP8 weights with one
scale per output row (what a merged layer of per-tensor parts carries). Options: the parts as separate per-tensor
`_scaled_mm` calls, cuBLAS row-wise, one per-tensor `_scaled_mm` (the merged GEMM when the parts' scale ratios are
deferred to the consumers, lowbit.serve.layers.merge), lowbit's Triton scaled GEMM, per-tensor `_scaled_mm` into fp32 followed by
the row scales (lowbit's pick off Hopper up to w8a8.PER_TENSOR_THEN_SCALE_MAX_M), lowbit's small-M FP8 GEMM
(fp8_small_m, M <= 32) and `lowbit` = what w8a8.w8a8_linear_prequantized dispatches to; bf16 cuBLAS for scale. Error vs the fp32
reference and median us (CUDA-graph replays over weight copies beyond L2, as dev/bench/kernels.py times).

`python3 dev/bench/fp8_merged_gemm.py [--json FILE]`
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from lab import load_script
from lowbit.kernels.linear import fp8_small_m as fsm
from lowbit.kernels.linear import scaled_gemm as sg
from lowbit.kernels.linear import w8a8

SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [14336, 14336])}  # in, out rows per part
MS = (1, 16, 64, 256, 512, 4096, 8192)
SMALL_M_TILES = ((16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 256, 4, 3), (64, 128, 128, 4, 4))


def fp8(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-448, 448).to(torch.float8_e4m3fn)


def options(x, sa, row_scale, parts, one):
    """name -> op(weight) for one merged weight [N, K]."""
    m = x.shape[0]
    small_m = {"fp8_small_m": lambda w: fsm.fp8_small_m_gemm(x, w, sa, row_scale, None, torch.bfloat16)}
    return ({} if m > fsm.MAX_M else small_m) | {
        "separate": lambda w: [torch._scaled_mm(x, p.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16)
                               for p in w.split(parts)],
        "rowwise": lambda w: torch._scaled_mm(x, w.t(), scale_a=sa.expand(m, 1).contiguous(),
                                              scale_b=row_scale.reshape(1, -1), out_dtype=torch.bfloat16),
        "per_tensor": lambda w: torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16),
        "per_tensor_fast_accum": lambda w: torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16,
                                                            use_fast_accum=True),
        "triton": lambda w: sg.scaled_gemm(x, w, sa, row_scale, None, torch.bfloat16),
        "fp32_then_scale": lambda w: w8a8._per_tensor_then_column_scale(x, w, sa, row_scale, None, torch.bfloat16),
        "lowbit": lambda w: w8a8.w8a8_linear_prequantized(x, w, row_scale, sa, None, torch.bfloat16),
    }


def measure(kb, name: str, k: int, parts: list[int], m: int) -> list[dict]:
    dev, n = "cuda", sum(parts)
    x = fp8(torch.randn(m, k, device=dev) * 50)
    sa, one = torch.tensor(0.01, device=dev), torch.ones((), device=dev)
    row_scale = torch.rand(n, device=dev) * 1e-3 + 1e-4
    weights = [fp8(torch.randn(n, k, device=dev) * 100) for _ in range(kb.copies_for(n * k))]
    repeat = max(1, -(-16 // len(weights))) if m <= 256 else 1
    ref = sg.scaled_gemm_ref(x, weights[0], sa, row_scale, None, torch.bfloat16).float()
    row = {"shape": name, "M": m}
    for option, op in options(x, sa, row_scale, parts, one).items():
        if not option.startswith(("separate", "per_tensor")):  # these leave the row scales out
            row[f"err_{option}"] = round(((op(weights[0]).float() - ref).norm() / ref.norm()).item(), 6)
        row[f"us_{option}"] = round(kb.time_us([lambda w=w, op=op: op(w) for w in weights] * repeat, 50), 2)
    rows = [row]
    if m <= 64:
        for tile in SMALL_M_TILES:
            us = kb.time_us([lambda w=w: sg.scaled_gemm(x, w, sa, row_scale, None, torch.bfloat16, config=tile)
                             for w in weights] * repeat, 50)
            rows.append({"shape": name, "M": m, "triton_tile": tile, "us": round(us, 2)})
    del weights
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(kb.copies_for(2 * n * k))]
    xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    repeat = max(1, -(-16 // len(dense))) if m <= 256 else 1
    row["us_bf16"] = round(kb.time_us([lambda w=w: F.linear(xb, w) for w in dense] * repeat, 50), 2)
    del dense
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    kb, results = load_script("kernels.py"), []
    for name, (k, parts) in SHAPES.items():
        for m in MS:
            for row in measure(kb, name, k, parts, m):
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
