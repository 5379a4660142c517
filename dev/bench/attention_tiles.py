"""Paged decode attention on the GPU at Llama-8B heads (32 query / 8 KV heads, D 128, block 16, shuffled block
tables): every DecodeVariant of lowbit/kernels/attention/paged_attention.py, FP8 KV for the FP8 tiles and bf16 KV for the bf16
one (the bandwidth reference), plus what `decode_variant` picks at each case ("auto"). First every variant against
paged_decode_ref on fresh random inputs (rel. error < CHECK_TOL at 1 and 16 splits, the two kernel specializations
the timings use), then `triton.testing.do_bench` medians at VARIANT_CASES with GB/s of the K/V bytes read plus q and
out. JSON lines, then a markdown table. About 1 min on an H200, mostly compiles. Prefill: dev/bench/prefill_tiles.py.

`python3 dev/bench/attention_tiles.py [--variants a,b] [--budget-s S] [--json FILE]`
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402

BLOCK, HK, HQ, D = 16, 8, 32, 128


def paged_cache(kv_dtype, seqs: int, ctx: int):
    """A filled KV cache for `seqs` sequences of `ctx` tokens, block tables in shuffled order (rows padded to a
    multiple of 16 entries)."""
    per_seq = -(-ctx // BLOCK)
    blocks = seqs * per_seq
    cache = torch.randn(2, blocks, BLOCK, HK, D, device="cuda").to(kv_dtype)
    tables = torch.zeros(seqs, -(-per_seq // 16) * 16, dtype=torch.int32, device="cuda")
    tables[:, :per_seq] = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    return cache, tables, lens


def median_us(fn, warmup: int, rep: int) -> float:
    import triton

    return round(1e3 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"), 1)


# (batch, context): 1000/1000 and 128/128 serving (512 x 1500, 256 / 512 x 200), long contexts, batch 1
VARIANT_CASES = ((512, 1500), (256, 200), (512, 200), (256, 1024), (64, 4096), (1, 4096), (1, 32768))
CHECK_CTX = (1, 17, 300, 1500, 4096, 33)  # the check batch: 1-token and partial tiles, long contexts
CHECK_SPLITS = (1, 16)  # the kernel specializations the timings use (direct output; 16 splits at batch 1)
CHECK_TOL = 1e-2  # relative L2 error vs paged_decode_ref (itself bf16); the engine measured <= 3.5e-3 for FP8 KV
BF16 = "rows64"  # the bf16-KV tiles: that variant runs on a bf16 cache, every other one on an FP8 cache
AUTO = "auto"  # paged_decode's own choice (decode_variant) on an FP8 cache


# Candidates not in DECODE_VARIANTS (FP8, V^T cache); none beat the engine's tiles in run 38. dev/bench/offline_compile.py,
# registers / shared memory per program: engine blk64w2s3 178 / 38.9 KB (2 warps per scheduler), blk32w2s3 121 /
# 21.5 KB; blk32w2s4 120 / 29.7 KB; blk64w2s3r168 160 / 38.9 KB (3 warps per scheduler); blk64w2s4 178 / 55 KB.
EXPERIMENTS = {
    "blk32w2s4": pa.DecodeVariant(32, 2, 4, blocks=True),
    "blk64w2s3r168": pa.DecodeVariant(64, 2, 3, blocks=True, maxnreg=168),
    "blk64w2s4": pa.DecodeVariant(64, 2, 4, blocks=True),
}


def _selected_variants(names) -> dict:
    """name -> (KV dtype, DecodeVariant or None for AUTO). Without names: DECODE_VARIANTS (EXPERIMENTS by name)."""
    known = {**tuning.current().decode_variants, **(EXPERIMENTS if names else {})}
    variants = {n: (torch.bfloat16 if n == BF16 else torch.float8_e4m3fn, v) for n, v in known.items()}
    variants[AUTO] = (torch.float8_e4m3fn, None)
    if names:
        unknown = set(names) - set(variants)
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(variants)}")
        variants = {n: variants[n] for n in variants if n in names or n in (BF16, AUTO)}
    return variants


def _check_inputs(kv_dtype, seed: int):
    """Fresh random q and K/V at Llama-8B heads for CHECK_CTX, K/V stored as the engine stores them (FP8: k / k_scale,
    calibrated-like per-tensor scales), block tables shuffled and padded to 16 entries."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = [-(-c // BLOCK) for c in CHECK_CTX]
    perm = torch.randperm(sum(per) + 5, device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros(len(per), -(-max(per) // 16) * 16, dtype=torch.int32, device="cuda")
    slots, start = [], 0
    for b, (n, ctx) in enumerate(zip(per, CHECK_CTX)):
        tables[b, :n] = perm[start:start + n]
        start += n
        pos = torch.arange(ctx, device="cuda")
        slots.append(tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    slots = torch.cat(slots)
    k = torch.randn(len(slots), HK, D, device="cuda", generator=g, dtype=torch.bfloat16) * 2
    v = torch.randn(len(slots), HK, D, device="cuda", generator=g, dtype=torch.bfloat16)
    scales = (k.abs().amax().float() / pa.FP8_MAX, v.abs().amax().float() / pa.FP8_MAX)
    cache = torch.zeros(2, sum(per) + 5, BLOCK, HK, D, device="cuda", dtype=kv_dtype)
    pa.store_kv_ref(k, v, cache, slots, *scales)
    q = torch.randn(len(per), HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor(CHECK_CTX, dtype=torch.int32, device="cuda")
    return q, cache, tables, lens, *scales


def check_variants(variants: dict) -> dict:
    """name -> check row; PASS: within CHECK_TOL of the reference at every split count."""
    inputs = {dt: _check_inputs(dt, seed=7 + i) for i, dt in enumerate({dt for dt, _ in variants.values()})}
    refs = {dt: pa.paged_decode_ref(q, cache, tables, lens, D ** -0.5, ks, vs)
            for dt, (q, cache, tables, lens, ks, vs) in inputs.items()}
    rows = {}
    for name, (kv_dtype, v) in variants.items():
        t = time.time()
        q, cache, tables, lens, ks, vs = inputs[kv_dtype]
        row = {"phase": "check", "variant": name, "kv": str(kv_dtype).split(".")[-1],
               "config": v._asdict() if v else "decode_variant"}
        for splits in CHECK_SPLITS:
            out = pa.paged_decode(q, cache, tables, lens, D ** -0.5, ks, vs, num_splits=splits, variant=v)
            err = ((out.float() - refs[kv_dtype].float()).norm() / refs[kv_dtype].float().norm()).item()
            row[f"rel_err_{splits}split"] = round(err, 6)
        ok = all(row[f"rel_err_{s}split"] < CHECK_TOL for s in CHECK_SPLITS)  # False for NaN
        row["check"] = "PASS" if ok else "FAIL"
        row["compile_and_check_s"] = round(time.time() - t, 1)
        rows[name] = row
        print(json.dumps(row), flush=True)
    return rows


def time_variants(variants: dict, t0: float, budget_s: float) -> list[dict]:
    """do_bench medians of every variant at VARIANT_CASES; GB/s of K/V read (every token once) plus q and out."""
    one, rows = torch.ones((), device="cuda"), []
    for batch, ctx in VARIANT_CASES:
        data = {dt: paged_cache(dt, batch, ctx) for dt in {dt for dt, _ in variants.values()}}
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        for name, (kv_dtype, v) in variants.items():
            row = {"phase": "time", "variant": name, "kv": str(kv_dtype).split(".")[-1], "batch": batch, "ctx": ctx,
                   "splits": pa.decode_splits(batch, HK)}
            if time.time() - t0 > budget_s:
                row["skipped"] = f"past --budget-s {budget_s}"
            else:
                cache, tables, lens = data[kv_dtype]
                row["us"] = median_us(lambda: pa.paged_decode(q, cache, tables, lens, D ** -0.5, one, one, variant=v),
                                      10, 50)
                nbytes = batch * ctx * 2 * HK * D * cache.element_size() + 2 * q.numel() * q.element_size()
                row["GB_s"] = round(nbytes / row["us"] / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del data
    return rows


def decode_variants(names=None, budget_s: float = 140.0) -> list[dict]:
    t0 = time.time()
    variants = _selected_variants(names)
    checks = check_variants(variants)
    print(f"# checks done in {time.time() - t0:.0f} s", flush=True)
    timed = time_variants(variants, t0, budget_s)
    print(f"# timings done, {time.time() - t0:.0f} s in all", flush=True)
    cases = [f"{b}x{c}" for b, c in VARIANT_CASES]
    print("\n| variant | check | " + " | ".join(f"{c} us (GB/s)" for c in cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    for name in variants:
        cells = [f"{r['us']} ({r['GB_s']})" if "us" in r else "skipped" for r in timed if r["variant"] == name]
        print(f"| {name} | {checks[name]['check']} | " + " | ".join(cells) + " |")
    return list(checks.values()) + timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--variants", help="comma-separated names (default: all)")
    p.add_argument("--budget-s", type=float, default=140.0, help="time no further rows after this many seconds")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    rows = decode_variants(args.variants.split(",") if args.variants else None, args.budget_s)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("check") != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
