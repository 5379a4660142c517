"""Paged decode attention at small batches (Llama-8B heads: 32 query / 8 KV heads, D 128, block 16, shuffled block
tables), the engine's tiles (decode_variant) under other numbers of context splits (a short context leaves some of them
idle). Each is checked against paged_decode_ref, then timed as CUDA-graph replays of 20 consecutive calls (kernel and
combine, launch gaps included, as in the engine's decode graph). us per call; "engine" marks decode_splits' choices.
bf16 KV (the int4_awq / nvfp4 / bf16 checkpoints) and FP8 KV (fp8).

`python3 dev/bench/decode_splits.py [--batches 1,4,16,64] [--contexts 256,1024,4096,32768] [--splits x1,x2,x4,x8]
[--json FILE]`  (splits: xN a multiple of the engine's decode_splits, capped at 128, or a number)
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench_cli import int_list  # noqa: E402
from lowbit.kernels.attention import paged_attention as pa  # noqa: E402

BLOCK, HK, HQ, D = 16, 8, 32, 128
CALLS = 20  # paged_decode calls per graph
CHECK_TOL = 1e-2  # relative L2 error vs paged_decode_ref (bf16 output)
MAX = 128  # splits at most


def case(kv_dtype, batch: int, ctx: int):
    per_seq = -(-ctx // BLOCK)
    nblk = batch * per_seq
    cache = torch.randn(2, nblk, BLOCK, HK, D, device="cuda").clamp(-4, 4).to(kv_dtype)
    table = torch.zeros(batch, -(-per_seq // 16) * 16, dtype=torch.int32, device="cuda")
    table[:, :per_seq] = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
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
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="256,1024,4096,32768")
    ap.add_argument("--splits", default="x1,x2,x4,x8")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches, contexts = int_list(ap, "--batches", args.batches), int_list(ap, "--contexts", args.contexts)
    multiples = int_list(ap, "--splits", ",".join(m[1:] for m in args.splits.split(",") if m.startswith("x")))
    fixed = int_list(ap, "--splits", ",".join(m for m in args.splits.split(",") if not m.startswith("x")))
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = open(args.json, "w") if args.json else sys.stdout
    one = torch.tensor(1.0, device="cuda")
    failed, rows = 0, []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        kv = str(kv_dtype).split(".")[-1]
        for batch in batches:
            base = pa.decode_splits(batch, HK)
            long = pa.decode_splits(batch, HK, pa.long_context(batch) + 1)
            for s in sorted({min(MAX, base * m) for m in multiples} | set(fixed) | {long}):
                q, cache, bt, lens = case(kv_dtype, batch, 300)
                lens[1:] = torch.randint(1, 301, (batch - 1,), device="cuda")  # 1-token and partial-tile contexts
                ref = pa.paged_decode_ref(q, cache, bt, lens, D ** -0.5, one, one)
                got = pa.paged_decode(q, cache, bt, lens, D ** -0.5, one, one, num_splits=s)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                failed += err >= CHECK_TOL
                print(json.dumps({"kind": "check", "kv": kv, "batch": batch, "splits": s,
                                  "rel_err": round(err, 6), "ok": err < CHECK_TOL}), file=out)
                if err >= CHECK_TOL:
                    continue
                row = {"kind": "time", "kv": kv, "batch": batch, "splits": s,
                       "engine": ["short contexts"] * (s == base)
                       + [f"over {pa.long_context(batch)} keys"] * (s == long)}
                for ctx in contexts:
                    q, cache, bt, lens = case(kv_dtype, batch, ctx)
                    row[ctx] = graph_us(lambda: pa.paged_decode(q, cache, bt, lens, D ** -0.5, one, one, num_splits=s))
                    del cache
                print(json.dumps(row), file=out)
                rows.append(row)
    print("\n| KV | batch | splits | " + " | ".join(f"ctx {c}" for c in contexts) + " |")
    print("|---|---|---|" + "---|" * len(contexts))
    for r in rows:
        mark = f" (engine: {', '.join(r['engine'])})" if r["engine"] else ""
        print(f"| {r['kv']} | {r['batch']} | {r['splits']}{mark} | "
              + " | ".join(str(r[c]) for c in contexts) + " |")
    print(f"checks failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
