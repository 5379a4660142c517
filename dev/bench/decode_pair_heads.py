"""FP8 decode attention with two KV heads per program (an experiment; the engine does not run it).

Hypothesis: FP8 decode attention streams ~3.4 TB/s against bf16's ~4.3 because one KV head's row of a cached token is
128 bytes (bf16: 256). Two neighbouring KV heads' rows are adjacent in the cache ([blocks, 2, block, Hk, D] with
heads contiguous), so viewing the cache as Hk / 2 heads of width 2D gives 256-byte rows without moving any data.
Each query head's q goes into its KV head's half of a zero 2D-wide row: its scores against the pair's rows are
exact (the other half multiplies zeros), and its output is the matching half of the 2D-wide result. The extra
product costs FLOPs only, which decode has to spare. Every variant is checked against paged_decode_ref first.

`python3 dev/bench/decode_pair_heads.py [--cases 512x1500,...] [--json FILE]` (GPU only)
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench_cli import int_pairs  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels.attention.paged_attention import DecodeVariant  # noqa: E402

CASES = "512x1500,768x1500,256x1024,64x4096,512x200,1024x200"
PAIRED = {"p-blk64w2": DecodeVariant(64, 2, 1, blocks=True), "p-blk64w4": DecodeVariant(64, 4, 1, blocks=True),
          "p-blk32w2": DecodeVariant(32, 2, 1, blocks=True), "p-blk128w4": DecodeVariant(128, 4, 1, blocks=True),
          "p-blk64w4s2": DecodeVariant(64, 4, 2, blocks=True)}  # FP8 V is read block by block (V^T per block)


def paired_decode(q, cache, tables, lens, scale, k_scale, v_scale, variant):
    """paged_decode over the pair view: q [B, Hq, D] -> [B, Hq, D], same contract as paged_decode_ref."""
    b, hq, d = q.shape
    hk = cache.shape[3]
    g = hq // hk
    heads = torch.arange(hq, device=q.device)
    half = (heads // g) % 2  # which half of its pair a query head's KV head is
    qp = q.new_zeros(b, hq, 2, d)
    qp[:, heads, half] = q
    pair_view = cache.view(2, cache.shape[1], cache.shape[2], hk // 2, 2 * d)
    out = pa.paged_decode(qp.view(b, hq, 2 * d), pair_view, tables, lens, scale, k_scale, v_scale, variant=variant)
    return out.view(b, hq, 2, d)[:, heads, half]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=CASES)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    tiles = load_script("attention_tiles.py")
    cases = int_pairs(p, "--cases", a.cases)
    one, rows = torch.ones((), device="cuda"), []
    for batch, ctx in cases:
        cache, tables, lens = tiles.paged_cache(torch.float8_e4m3fn, batch, ctx)
        q = torch.randn(batch, tiles.HQ, tiles.D, device="cuda", dtype=torch.bfloat16)
        scale = tiles.D ** -0.5
        ref = pa.paged_decode_ref(q, cache, tables, lens, scale, one, one)
        runs = {"engine": lambda: pa.paged_decode(q, cache, tables, lens, scale, one, one)}
        runs.update({n: (lambda v=v: paired_decode(q, cache, tables, lens, scale, one, one, v)) for n, v in PAIRED.items()})
        nbytes = batch * ctx * 2 * tiles.HK * tiles.D
        for name, fn in runs.items():
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            row = {"case": f"{batch}x{ctx}", "variant": name, "rel_err": f"{err:.1e}", "check": err < 1e-2}
            if row["check"]:
                row["us"] = tiles.median_us(fn, 10, 50)
                row["GB_s"] = round(nbytes / row["us"] / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = ["engine"] + list(PAIRED)
    print("\n| case | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for c in dict.fromkeys(r["case"] for r in rows):
        cells = [next(r for r in rows if r["case"] == c and r["variant"] == n) for n in names]
        print(f"| {c} | " + " | ".join(f"{r['us']} ({r['GB_s']})" if r["check"] else "FAIL" for r in cells) + " |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["check"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
