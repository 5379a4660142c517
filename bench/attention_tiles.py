"""Paged attention tile sweep on the GPU (decode and prefill, bf16 and FP8 KV): do_bench medians per config, JSON
lines on stdout and $OUT/attn_tune.json. Picks for lowbit/kernels/paged_attention.py DECODE_CONFIG / PREFILL_CONFIG."""
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
from lowbit.kernels import paged_attention as pa

dev = "cuda"
bs, hk, hq, d = 16, 8, 32, 128
one = torch.tensor(1.0, device=dev)
res = []

def decode_case(kv_dtype, batch, ctx):
    nblk = batch * ctx // bs
    cache = torch.randn(2, nblk, bs, hk, d, device=dev).to(kv_dtype)
    tables = torch.randperm(nblk, device=dev, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    return cache, tables, lens, q

for kv in (torch.bfloat16, torch.float8_e4m3fn):
    cases = [(b, c) for b, c in ((1, 4096), (1, 32768), (64, 1024), (64, 4096), (256, 1024))]
    data = {c: decode_case(kv, *c) for c in cases}
    f16s = (True, False) if kv == torch.float8_e4m3fn else (True,)
    for f16, bn, w, st in itertools.product(f16s, (32, 64, 128), (4, 8), (2, 3, 4)):
        pa.FP8_KV_F16_DOT = f16
        pa.DECODE_CONFIG[kv == torch.float8_e4m3fn] = (bn, w, st)
        row = {"op": "decode", "kv": str(kv)[6:], "f16": f16, "bn": bn, "w": w, "st": st}
        try:
            for (b, c), (cache, tables, lens, q) in data.items():
                ms = triton.testing.do_bench(lambda: pa.paged_decode(q, cache, tables, lens, d ** -0.5, one, one), warmup=10, rep=40, return_mode="median")
                row[f"{b}x{c}"] = round(ms * 1e3, 1)
        except Exception as e:
            row["error"] = repr(e)[:120]
        print(json.dumps(row), flush=True)
        res.append(row)
    del data
    torch.cuda.empty_cache()
pa.FP8_KV_F16_DOT = True

# prefill: 4 sequences x 2048 new tokens (no cache before), and 4 x 512 new after 1536 cached (extend)
for kv in (torch.bfloat16, torch.float8_e4m3fn):
    for qlen, ctx in ((2048, 2048), (512, 2048)):
        nseq = 4
        nblk = nseq * ctx // bs
        cache = torch.randn(2, nblk, bs, hk, d, device=dev).to(kv)
        tables = torch.randperm(nblk, device=dev, dtype=torch.int32).view(nseq, -1)
        lens = torch.full((nseq,), ctx, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, nseq + 1, device=dev, dtype=torch.int32) * qlen
        q = torch.randn(nseq * qlen, hq, d, device=dev, dtype=torch.bfloat16)
        flops = 4 * nseq * hq * d * (qlen * (ctx - qlen) + qlen * qlen / 2)
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            if bm == 128 and bn == 128 and w == 4:
                continue
            pa.PREFILL_CONFIG[kv == torch.float8_e4m3fn] = (bm, bn, w, st)
            row = {"op": "prefill", "kv": str(kv)[6:], "qlen": qlen, "ctx": ctx, "bm": bm, "bn": bn, "w": w, "st": st}
            try:
                ms = triton.testing.do_bench(lambda: pa.paged_prefill(q, cache, qsl, lens, tables, qlen, d ** -0.5, one, one), warmup=5, rep=30, return_mode="median")
                row.update(us=round(ms * 1e3, 1), tflops=round(flops / ms / 1e9, 1))
            except Exception as e:
                row["error"] = repr(e)[:120]
            print(json.dumps(row), flush=True)
            res.append(row)
        del cache
with open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_tune.json"), "w") as f:
    json.dump(res, f)
