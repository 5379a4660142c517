"""Sliding-window and soft-capped attention on the GPU: the paged decode and prefill kernels against their torch
references (bf16 and FP8 caches, Llama-8B and Gemma-shaped heads, windows smaller than the context, NaN poisoned
into the blocks before the window), then decode attention timed with a 4k window over a 32k context vs full.

    python3 dev/scripts/window_attention_check.py   # on a GPU, from the repository root; under 2 minutes
Prints one line per check (PASS/FAIL with the relative error) and the timings; exits 1 if any check fails.
"""
import sys

import torch

from lowbit.bench.kernels import time_us
from lowbit.kernels.attention import paged_attention as pa
from lowbit.kernels.attention.paged_prefill import paged_prefill

TOL = 1e-2  # relative L2 error vs the reference (bf16 output), as the plain kernels' tests
BS = 16


def case(ctx_lens, q_lens, hq, hk, d, fp8, seed=0):
    """A shuffled block pool with every sequence's K/V stored, q of the new tokens, and the kernel arguments."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-c // BS) for c in ctx_lens]
    perm = torch.randperm(sum(nblk) + 2, device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int32, device="cuda")
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[sum(nblk[:b]):sum(nblk[:b]) + n]
    cache = torch.zeros(2, sum(nblk) + 2, BS, hk, d, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                        device="cuda")
    pos = torch.cat([torch.arange(c, device="cuda") for c in ctx_lens])
    rows = torch.repeat_interleave(torch.arange(len(ctx_lens), device="cuda"), torch.tensor(ctx_lens, device="cuda"))
    slots = tables[rows, pos // BS].long() * BS + pos % BS
    scales = (torch.tensor(0.02, device="cuda"), torch.tensor(0.03, device="cuda")) if fp8 else (1.0, 1.0)
    k, v = (torch.randn(len(slots), hk, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    pa.store_kv(k, v, cache, slots, *scales)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    return q, cache, tables, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda"), qsl, scales


def poison(cache, tables, ctx_lens, q_lens, window):
    for b, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        dead = max(0, c - n - window + 1) // BS
        if dead:  # NaN bytes: 0x7f in float8_e4m3fn, 0x7fc0 in bfloat16
            bits = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache.view(torch.int16)
            bits[:, tables[b, :dead].long()] = 0x7F if cache.dtype == torch.float8_e4m3fn else 0x7FC0


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def checks() -> bool:
    ok = True
    ctx, dec = [1, 700, 5000, 2049], [1, 1, 1, 1]
    pctx, pq = [3000, 600, 1500], [3000, 128, 1]
    for (hq, hk, d) in ((32, 8, 128), (16, 8, 256)):  # Llama-3-8B, Gemma-2/3-shaped heads
        for fp8 in (False, True):
            for window, cap in ((4096, None), (512, None), (1000, 50.0), (None, 30.0)):
                for splits in (1, 8):
                    q, cache, tables, lens, _, sc = case(ctx, dec, hq, hk, d, fp8, seed=1)
                    kw = dict(sliding_window=window, logit_softcap=cap)
                    ref = pa.paged_decode_ref(q, cache, tables, lens, d ** -0.5, *sc, **kw)
                    if window:
                        poison(cache, tables, ctx, dec, window)
                    err = rel(pa.paged_decode(q, cache, tables, lens, d ** -0.5, *sc, num_splits=splits, **kw), ref)
                    ok &= report(f"decode  heads {hq}/{hk}x{d} fp8={fp8} window={window} softcap={cap} "
                                 f"splits={splits}", err)
                q, cache, tables, lens, qsl, sc = case(pctx, pq, hq, hk, d, fp8, seed=2)
                kw = dict(sliding_window=window, logit_softcap=cap)
                ref = pa.paged_prefill_ref(q, cache, qsl, lens, tables, max(pq), d ** -0.5, *sc, **kw)
                if window:
                    poison(cache, tables, pctx, pq, window)
                err = rel(paged_prefill(q, cache, qsl, lens, tables, max(pq), d ** -0.5, *sc, **kw), ref)
                ok &= report(f"prefill heads {hq}/{hk}x{d} fp8={fp8} window={window} softcap={cap}", err)
    return ok


def report(what: str, err: float) -> bool:
    good = err == err and err < TOL
    print(f"{'PASS' if good else 'FAIL'} {what}: rel err {err:.2e}", flush=True)
    return good


def timings() -> None:
    """Decode attention, Llama-8B heads, 32k context: full vs a 4k window (CUDA-graph replays, median us)."""
    for fp8 in (False, True):
        for batch in (1, 16):
            q, cache, tables, lens, _, sc = case([32768] * batch, [1] * batch, 32, 8, 128, fp8, seed=3)
            splits = pa.decode_splits(batch, 8, 32768)
            wsplits = pa.decode_splits(batch, 8, 4096 + BS)
            full = time_us([lambda: pa.paged_decode(q, cache, tables, lens, 128 ** -0.5, *sc,
                                                    num_splits=splits)] * 16, 20)
            win = time_us([lambda: pa.paged_decode(q, cache, tables, lens, 128 ** -0.5, *sc, num_splits=wsplits,
                                                   sliding_window=4096)] * 16, 20)
            print(f"TIME decode batch {batch} ctx 32768 {'fp8' if fp8 else 'bf16'} KV: full {full:.1f} us "
                  f"(splits {splits}), window 4096 {win:.1f} us (splits {wsplits}), {full / win:.1f}x", flush=True)


if __name__ == "__main__":
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    passed = checks()
    timings()
    sys.exit(0 if passed else 1)
