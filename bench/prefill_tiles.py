"""Prefill attention on the GPU at Llama-8B heads (32 query / 8 KV heads, D 128, block 16, shuffled block tables),
bf16 and FP8 KV: lowbit.kernels.paged_prefill over its tiles (the first row: the tiles it picks itself). Every config is first checked against paged_prefill_ref on the
same inputs (rel. error < 1e-2, per row < 3e-2); then `triton.testing.do_bench` medians and causal TFLOP/s.

`python3 bench/prefill_tiles.py [--json FILE]`
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.kernels import paged_attention as pa  # noqa: E402
from lowbit.kernels.paged_prefill import paged_prefill  # noqa: E402

BLOCK, HK, HQ, D = 16, 8, 32, 128
CASES = ((4, 2048, 2048), (64, 128, 128), (4, 512, 2048))  # (sequences, new tokens, context)
CONFIGS = ((16, 64, 4, 3), (32, 128, 8, 3), (16, 64, 4, 3, True), (16, 128, 4, 3, True), (32, 64, 4, 3, True),
           (32, 128, 8, 3, True), (32, 64, 8, 3, True), (64, 64, 8, 3, True))  # PrefillTiles; True: block-wise gather


def case_inputs(kv_dtype, seqs, qlen, ctx):
    blocks = seqs * ctx // BLOCK
    cache = (torch.randn(2, blocks, BLOCK, HK, D, device="cuda") * 2).to(kv_dtype)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
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
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    rows = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for seqs, qlen, ctx in CASES:
            args = case_inputs(kv_dtype, seqs, qlen, ctx)
            ref = pa.paged_prefill_ref(*args)
            flops = causal_flops(seqs, qlen, ctx)
            for config in (None,) + CONFIGS:
                name, fn = str(config or "default"), lambda c=config: paged_prefill(*args, config=c)
                rel, row_err = errors(fn(), ref)
                ok = rel < 1e-2 and row_err < 3e-2
                us = 1e3 * triton.testing.do_bench(fn, warmup=5, rep=a.reps, return_mode="median") if ok else None
                row = {"kv": str(kv_dtype).split(".")[-1], "case": f"{seqs}x{qlen}/{ctx}", "variant": name,
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
