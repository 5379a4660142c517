"""Paged attention tile sweep on the GPU at Llama-8B heads (32 query / 8 KV heads, D 128, block 16, shuffled block
tables), bf16 and FP8 KV: decode over (fp16 dots for FP8, BLOCK_N, warps, stages) and prefill over (BLOCK_M,
BLOCK_N, warps, stages); `triton.testing.do_bench` medians, one JSON line per config. The winners are
lowbit/kernels/paged_attention.py's DECODE_CONFIG / PREFILL_CONFIG (the sweep sets those dicts while it runs).

`python3 bench/attention_tiles.py [--json FILE]`

`--decode-fp8-variants`: instead of the sweep, the FP8-KV decode candidates of paged_attention.DECODE_VARIANTS (and
the bf16-KV kernel as it runs now, the bandwidth reference). First every variant against paged_decode_ref on fresh
random inputs (rel. error < CHECK_TOL at 1 and 16 splits, the two kernel specializations the timings use; the
bit-trick variants also against their native-conversion twins), then do_bench medians at VARIANT_CASES with GB/s of
the K/V bytes read plus q and out. JSON lines, then a markdown table. About 1-2 min on an H200, mostly compiles.
"""
import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from lowbit.kernels import paged_attention as pa

BLOCK, HK, HQ, D = 16, 8, 32, 128
DECODE_CASES = ((1, 4096), (1, 32768), (64, 1024), (64, 4096), (256, 1024))  # (batch, context)
PREFILL_CASES = ((2048, 2048), (512, 2048))  # (new tokens, context) for 4 sequences: prompts, and extends


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


# ---- FP8-KV decode candidates (--decode-fp8-variants)
# (batch, context): 1000/1000 and 128/128 serving (512 x 1500, 256 / 512 x 200), long contexts, batch 1
VARIANT_CASES = ((512, 1500), (256, 200), (512, 200), (256, 1024), (64, 4096), (1, 4096), (1, 32768))
CHECK_CTX = (1, 17, 300, 1500, 4096, 33)  # the check batch: 1-token and partial tiles, long contexts
CHECK_SPLITS = (1, 16)  # the kernel specializations the timings use (direct output; 16 splits at batch 1)
CHECK_TOL = 1e-2  # relative L2 error vs paged_decode_ref (itself bf16); the engine measured <= 3.5e-3 for FP8 KV
TWINS = {"rows128-bits": "rows128-early", "blk128-bits": "blk128"}  # bit-trick conversion vs the same kernel on cvt
TWIN_TOL = 1e-3  # relative difference to the twin: the same fp16 values up to 2^8, so equal up to summation order
BF16_REF = "bf16-ref"  # DECODE_CONFIG[False] on a bf16 cache: the bandwidth to reach


def _selected_variants(names) -> dict:
    variants = {BF16_REF: (torch.bfloat16, pa.DecodeVariant(*pa.DECODE_CONFIG[False])),
                "bf16-blk64": (torch.bfloat16, pa.DecodeVariant(64, 4, 1, blocks=True)),
                "bf16-blk128": (torch.bfloat16, pa.DecodeVariant(128, 4, 1, blocks=True))}
    variants.update({n: (torch.float8_e4m3fn, v) for n, v in pa.DECODE_VARIANTS.items()})
    if names:
        unknown = set(names) - set(variants)
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(variants)}")
        variants = {n: variants[n] for n in variants if n in names or n == BF16_REF}
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


def _rel(a, b) -> float | None:
    """Relative L2 difference; None when not finite (the upper-bound variants), so the JSON stays strict."""
    r = ((a.float() - b.float()).norm() / b.float().norm()).item()
    return r if r == r and r != float("inf") else None


def check_variants(variants: dict) -> dict:
    """name -> check row; PASS: finite and within CHECK_TOL of the reference at every split count (and within TWIN_TOL
    of its twin). The upper-bound variants are run (compiled) but not checked."""
    inputs = {dt: _check_inputs(dt, seed=7 + i) for i, dt in enumerate({dt for dt, _ in variants.values()})}
    refs = {dt: pa.paged_decode_ref(q, cache, tables, lens, D ** -0.5, ks, vs)
            for dt, (q, cache, tables, lens, ks, vs) in inputs.items()}
    rows, outs = {}, {}
    for name, (kv_dtype, v) in variants.items():
        t = time.time()
        q, cache, tables, lens, ks, vs = inputs[kv_dtype]
        row = {"phase": "check", "variant": name, "kv": str(kv_dtype).split(".")[-1], "config": v._asdict()}
        for splits in CHECK_SPLITS:
            out = pa.paged_decode(q, cache, tables, lens, D ** -0.5, ks, vs, num_splits=splits, variant=v)
            outs[name, splits] = out
            err = _rel(out, refs[kv_dtype])
            row[f"rel_err_{splits}split"] = None if err is None else round(err, 6)
        ok = all(row[f"rel_err_{s}split"] is not None and row[f"rel_err_{s}split"] < CHECK_TOL for s in CHECK_SPLITS)
        if name in TWINS and TWINS[name] in variants:
            twin = [_rel(outs[name, s], outs[TWINS[name], s]) for s in CHECK_SPLITS]
            row["twin"], row["twin_rel_diff"] = TWINS[name], None if None in twin else max(twin)
            row["twin_bitwise_equal"] = all(torch.equal(outs[name, s], outs[TWINS[name], s]) for s in CHECK_SPLITS)
            ok = ok and row["twin_rel_diff"] is not None and row["twin_rel_diff"] < TWIN_TOL
        row["check"] = "UB (wrong by design, not checked)" if v.no_convert else "PASS" if ok else "FAIL"
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


def decode_fp8_variants(names=None, budget_s: float = 140.0) -> list[dict]:
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
        cells = [f"{r['us']} ({r['GB_s']})" if "us" in r else "skipped"
                 for r in timed if r["variant"] == name]
        print(f"| {name} | {checks[name]['check'].split(' ')[0]} | " + " | ".join(cells) + " |")
    return list(checks.values()) + timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--decode-fp8-variants", action="store_true", help="check and time DECODE_VARIANTS (no sweep)")
    p.add_argument("--variants", help="with --decode-fp8-variants: comma-separated names (default: all)")
    p.add_argument("--budget-s", type=float, default=140.0,
                   help="with --decode-fp8-variants: time no further rows after this many seconds")
    args = p.parse_args(argv)
    if args.decode_fp8_variants:
        rows = decode_fp8_variants(args.variants.split(",") if args.variants else None, args.budget_s)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0 if all(r.get("check") != "FAIL" for r in rows) else 1
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
