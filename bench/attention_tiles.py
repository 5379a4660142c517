"""Paged attention tile sweep on the GPU at Llama-8B heads (32 query / 8 KV heads, D 128, block 16, shuffled block
tables), bf16 and FP8 KV: decode over (fp16 dots for FP8, BLOCK_N, warps, stages) and prefill over (BLOCK_M,
BLOCK_N, warps, stages); `triton.testing.do_bench` medians, one JSON line per config. The winners are
lowbit/kernels/paged_attention.py's DECODE_CONFIG / PREFILL_CONFIG (the sweep sets those dicts while it runs).

`python3 bench/attention_tiles.py [--json FILE]`
"""
import argparse
import itertools
import json
from pathlib import Path

import torch

from lowbit.kernels import paged_attention as pa

BLOCK, HK, HQ, D = 16, 8, 32, 128
DECODE_CASES = ((1, 4096), (1, 32768), (64, 1024), (64, 4096), (256, 1024))  # (batch, context)
PREFILL_CASES = ((2048, 2048), (512, 2048))  # (new tokens, context) for 4 sequences: prompts, and extends


def paged_cache(kv_dtype, seqs: int, ctx: int):
    """A filled KV cache for `seqs` sequences of `ctx` tokens, block tables in shuffled order."""
    blocks = seqs * ctx // BLOCK
    cache = torch.randn(2, blocks, BLOCK, HK, D, device="cuda").to(kv_dtype)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    return cache, tables, lens


def median_us(fn, warmup: int, rep: int) -> float:
    import triton

    return round(1e3 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"), 1)


def sweep_decode(kv_dtype) -> list[dict]:
    fp8, one = kv_dtype == torch.float8_e4m3fn, torch.ones((), device="cuda")
    cases = {case: (*paged_cache(kv_dtype, *case), torch.randn(case[0], HQ, D, device="cuda", dtype=torch.bfloat16))
             for case in DECODE_CASES}
    rows = []
    for f16, block_n, warps, stages in itertools.product((True, False) if fp8 else (True,), (32, 64, 128), (4, 8),
                                                         (2, 3, 4)):
        pa.FP8_KV_F16_DOT, pa.DECODE_CONFIG[fp8] = f16, (block_n, warps, stages)
        row = {"op": "decode", "kv": str(kv_dtype), "f16_dot": f16, "block_n": block_n, "warps": warps,
               "stages": stages}
        for (batch, ctx), (cache, tables, lens, q) in cases.items():
            row[f"us_{batch}x{ctx}"] = median_us(lambda: pa.paged_decode(q, cache, tables, lens, D ** -0.5, one, one),
                                                 10, 40)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep_prefill(kv_dtype) -> list[dict]:
    fp8, one, seqs = kv_dtype == torch.float8_e4m3fn, torch.ones((), device="cuda"), 4
    rows = []
    for qlen, ctx in PREFILL_CASES:
        cache, tables, lens = paged_cache(kv_dtype, seqs, ctx)
        qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * qlen
        q = torch.randn(seqs * qlen, HQ, D, device="cuda", dtype=torch.bfloat16)
        flops = 4 * seqs * HQ * D * (qlen * (ctx - qlen) + qlen * qlen / 2)  # causal
        for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            if (block_m, block_n, warps) == (128, 128, 4):  # too many registers per thread
                continue
            pa.PREFILL_CONFIG[fp8] = (block_m, block_n, warps, stages)
            us = median_us(lambda: pa.paged_prefill(q, cache, qsl, lens, tables, qlen, D ** -0.5, one, one), 5, 30)
            row = {"op": "prefill", "kv": str(kv_dtype), "new_tokens": qlen, "ctx": ctx, "block_m": block_m,
                   "block_n": block_n, "warps": warps, "stages": stages, "us": us, "tflops": round(flops / us / 1e6, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    saved = (pa.FP8_KV_F16_DOT, dict(pa.DECODE_CONFIG), dict(pa.PREFILL_CONFIG))
    rows = []
    try:
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            rows += sweep_decode(kv_dtype) + sweep_prefill(kv_dtype)
    finally:
        pa.FP8_KV_F16_DOT, pa.DECODE_CONFIG, pa.PREFILL_CONFIG = saved
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
