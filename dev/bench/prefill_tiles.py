"""Prefill attention on the GPU at Llama-8B heads (32 query / 8 KV heads, D 128, block 16, shuffled block tables),
bf16 and FP8 KV: lowbit.kernels.attention.paged_prefill over its tiles (the first row: the tiles it picks itself). Every config is first checked against paged_prefill_ref on the
same inputs (rel. error < 1e-2, per row < 3e-2); then `triton.testing.do_bench` medians and causal TFLOP/s.

`python3 dev/bench/prefill_tiles.py [--kv bf16,fp8] [--cases 4x2048/2048] [--configs "None;(64, 64, 8, 3)"]
[--tables shuffled|contiguous] [--pool-blocks N] [--json FILE]`
"""
import argparse
import ast
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels.attention.paged_prefill import paged_prefill  # noqa: E402

BLOCK, HK, HQ, D = 16, 8, 32, 128
CASES = ((4, 2048, 2048), (64, 128, 128), (4, 512, 2048))  # (sequences, new tokens, context)
# PrefillTiles (block_t, block_n, warps, stages, blocks, dot_acc, heavy_first)
CONFIGS = ((16, 64, 4, 3), (32, 128, 8, 3), (16, 64, 4, 3, True), (32, 128, 8, 3, True),
           (16, 64, 4, 3, False, True), (16, 64, 4, 3, False, False, True), (16, 64, 4, 3, False, True, True),
           (32, 128, 8, 3, False, True), (32, 128, 8, 3, False, False, True), (32, 128, 8, 3, False, True, True),
           (64, 64, 8, 3, False, True, True),
           # block-wise, for the V-transposed FP8 cache; dev/bench/offline_compile.py prefill on it, registers / spilled bytes:
           # (64, 64, 8, 3) the engine's 255 / 272, (32, 64, 4, 3) 255 / 472; these three spill nothing:
           # (32, 64, 8, 3) 220, (32, 32, 8, 3) 209, (32, 64, 8, 2) 229
           (64, 64, 8, 3, True, True, True), (32, 64, 8, 3, True, True, True), (32, 32, 8, 3, True, True, True),
           (32, 64, 8, 2, True, True, True))
TOL = (1e-2, 3e-2)  # (relative error, worst row)


def case_inputs(kv_dtype, seqs, qlen, ctx, tables="shuffled", pool_blocks=0):
    """Inputs of one case. tables: the sequences' blocks in a random order ("shuffled") or one after another
    ("contiguous", as a fresh engine pool hands them out); pool_blocks: the cache's size in blocks (at least what
    the case needs; the engine's pool at Llama-8B FP8 is ~118k blocks per layer), unused blocks zero."""
    blocks = seqs * ctx // BLOCK
    pool = max(pool_blocks, blocks)
    ids = (torch.randperm(pool, device="cuda")[:blocks] if tables == "shuffled" else
           torch.arange(blocks, device="cuda")).to(torch.int32)
    cache = torch.zeros(2, pool, BLOCK, HK, D, device="cuda", dtype=kv_dtype)
    cache[:, ids.long()] = (torch.randn(2, blocks, BLOCK, HK, D, device="cuda") * 2).to(kv_dtype)
    tables = ids.view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * qlen
    q = torch.randn(seqs * qlen, HQ, D, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.5, device="cuda")
    return (q, cache, qsl, lens, tables, qlen, D ** -0.5, scale, scale)


def causal_flops(seqs, qlen, ctx):
    return 4 * seqs * HQ * D * (qlen * (ctx - qlen) + qlen * qlen / 2)


def errors(out, ref):
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    row = ((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max().item()
    return rel, row


def main(argv=None) -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--kv", default="bf16,fp8", help="KV dtypes: bf16,fp8")
    p.add_argument("--cases", help="SEQSxNEW/CONTEXT,... (default: all of CASES)")
    p.add_argument("--configs", help="PrefillTiles tuples separated by ';', 'None' for the default pick "
                   "(default: all of CONFIGS)")
    p.add_argument("--tables", choices=("shuffled", "contiguous"), default="shuffled")
    p.add_argument("--pool-blocks", type=int, default=0, help="cache size in blocks (default: what the case needs)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    try:
        kv_dtypes = [{"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[k] for k in a.kv.split(",")]
        cases = CASES if not a.cases else [tuple(int(v) for v in c.replace("/", "x").split("x"))
                                           for c in a.cases.split(",")]
        if any(len(c) != 3 or min(c) <= 0 or c[1] > c[2] for c in cases):
            raise ValueError("a case is SEQSxNEW/CONTEXT, positive, NEW <= CONTEXT")
        chosen = None if not a.configs else [ast.literal_eval(c.strip()) for c in a.configs.split(";")]
        if chosen and not all(c is None or (isinstance(c, tuple) and 4 <= len(c) <= 7) for c in chosen):
            raise ValueError("each config is None or a PrefillTiles tuple of 4 to 7 fields")
    except (KeyError, ValueError, SyntaxError) as e:
        p.error(f"bad --kv / --cases / --configs: {e}")
    rows = []
    for kv_dtype in kv_dtypes:
        for seqs, qlen, ctx in cases:
            args = case_inputs(kv_dtype, seqs, qlen, ctx, a.tables, a.pool_blocks)
            ref = pa.paged_prefill_ref(*args)
            flops = causal_flops(seqs, qlen, ctx)
            for config in chosen or (None,) + CONFIGS:
                name, fn = str(config or "default"), lambda c=config: paged_prefill(*args, config=c)
                rel, row_err = errors(fn(), ref)
                ok = rel < TOL[0] and row_err < TOL[1]
                us = 1e3 * triton.testing.do_bench(fn, warmup=5, rep=a.reps, return_mode="median") if ok else None
                row = {"kv": str(kv_dtype).split(".")[-1], "case": f"{seqs}x{qlen}/{ctx}", "tables": a.tables,
                       "pool_blocks": args[1].shape[1], "variant": name,
                       "rel_err": f"{rel:.2e}", "row_err": f"{row_err:.2e}", "check": "PASS" if ok else "FAIL",
                       "us": round(us, 1) if us else None, "tflops": round(flops / us / 1e6, 1) if us else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| kv | case | variant | check | us | TFLOP/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv']} | {r['case']} | {r['variant']} | {r['check']} | {r['us']} | {r['tflops']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["check"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
