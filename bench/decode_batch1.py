"""Paged decode attention at batch 1 (Llama-8B heads: 32 query / 8 KV heads, D 128, block 16, shuffled block table):
tiles x context splits, each checked against paged_decode_ref, then timed as CUDA-graph replays of 20 consecutive
calls (kernel and combine, launch gaps included, as in the engine's decode graph). us per call; "engine" is what
paged_decode picks by itself. bf16 KV (int4_awq / nvfp4 / bf16 checkpoints) and FP8 KV (fp8).

`python3 bench/decode_batch1.py [--contexts 256,1024,4096,32768] [--splits 1,8,16,32,64] [--json FILE]`
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.kernels import paged_attention as pa  # noqa: E402

BLOCK, HK, HQ, D = 16, 8, 32, 128
CALLS = 20  # paged_decode calls per graph
CHECK_TOL = 1e-2  # relative L2 error vs paged_decode_ref (bf16 output)
VARIANTS = {  # name -> (DecodeVariant, KV dtype)
    "rows64": (pa.DecodeVariant(64, 4, 3), torch.bfloat16),
    "rows32w4": (pa.DecodeVariant(32, 4, 3), torch.bfloat16),
    "rows16w2": (pa.DecodeVariant(16, 2, 2), torch.bfloat16),
    "blk16w2s2-bf16": (pa.DecodeVariant(16, 2, 2, blocks=True), torch.bfloat16),
    "blk32w2s3-bf16": (pa.DecodeVariant(32, 2, 3, blocks=True), torch.bfloat16),
    "blk64w2s3": (pa.DecodeVariant(64, 2, 3, blocks=True), torch.float8_e4m3fn),
    "blk32w2s3": (pa.DecodeVariant(32, 2, 3, blocks=True), torch.float8_e4m3fn),
    "blk16w2s2": (pa.DecodeVariant(16, 2, 2, blocks=True), torch.float8_e4m3fn),
}


def case(kv_dtype, ctx: int):
    nblk = -(-ctx // BLOCK)
    cache = torch.randn(2, nblk, BLOCK, HK, D, device="cuda").clamp(-4, 4).to(kv_dtype)
    table = torch.zeros(1, -(-nblk // 16) * 16, dtype=torch.int32, device="cuda")
    table[0, :nblk] = torch.randperm(nblk, device="cuda", dtype=torch.int32)
    lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, cache, table, lens


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return round(sorted(times)[len(times) // 2], 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="256,1024,4096,32768")
    ap.add_argument("--splits", default="1,8,16,32,64")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    out = open(args.json, "w") if args.json else None
    one = torch.tensor(1.0, device="cuda")
    failed = 0
    table = {}
    for name in args.variants.split(","):
        variant, kv_dtype = VARIANTS[name]
        for s in splits:
            q, cache, bt, lens = case(kv_dtype, 300)
            ref = pa.paged_decode_ref(q, cache, bt, lens, D ** -0.5, one, one)
            got = pa.paged_decode(q, cache, bt, lens, D ** -0.5, one, one, num_splits=s, variant=variant)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            ok = err < CHECK_TOL
            failed += not ok
            rec = {"kind": "check", "variant": name, "splits": s, "rel_err": round(err, 6), "ok": ok}
            print(json.dumps(rec), file=out or sys.stdout)
            if not ok:
                continue
            for ctx in contexts:
                q, cache, bt, lens = case(kv_dtype, ctx)
                us = graph_us(lambda: pa.paged_decode(q, cache, bt, lens, D ** -0.5, one, one, num_splits=s,
                                                      variant=variant))
                table[(name, s, ctx)] = us
                print(json.dumps({"kind": "time", "variant": name, "splits": s, "ctx": ctx, "us": us}),
                      file=out or sys.stdout)
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for ctx in contexts:
            q, cache, bt, lens = case(kv_dtype, ctx)
            table[("engine-" + str(kv_dtype)[6:], pa.decode_splits(1, HK), ctx)] = graph_us(
                lambda: pa.paged_decode(q, cache, bt, lens, D ** -0.5, one, one))
    print(f"\n| variant | splits | " + " | ".join(f"ctx {c}" for c in contexts) + " |")
    print("|---|---|" + "---|" * len(contexts))
    for (name, s) in dict.fromkeys((n, s) for n, s, _ in table):
        print(f"| {name} | {s} | " + " | ".join(str(table.get((name, s, c), "-")) for c in contexts) + " |")
    print(f"checks failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
