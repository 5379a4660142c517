"""Paged attention kernels (KV store, decode with context splits, prefill/extend) against their torch references.

CPU: the Triton interpreter at tiny shapes in fp16/fp32 (bf16 tl.dot is wrong there). GPU: bf16 at Llama-8B heads.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels.attention.paged_prefill import paged_prefill  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(),
                                reason="needs a GPU or the Triton interpreter (TRITON_INTERPRET=1 before triton)")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(ctx_lens, q_lens, hq, hk, d, bs, dtype, kv_dtype, seed):
    """A KV pool with shuffled blocks; K/V of all but the new tokens stored with the reference."""
    g = torch.Generator().manual_seed(seed)
    nblk = [pa.cdiv(c, bs) for c in ctx_lens]
    perm = torch.randperm(sum(nblk) + 3, generator=g)
    tables = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int32)
    start = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[start:start + n]
        start += n
    cache = torch.zeros(2, sum(nblk) + 3, bs, hk, d, dtype=kv_dtype)
    scales = (torch.tensor(0.02), torch.tensor(0.03)) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    old = [c - n for c, n in zip(ctx_lens, q_lens)]
    slots_old, slots_new = [], []
    for b, c in enumerate(ctx_lens):
        slots = [int(tables[b, p // bs]) * bs + p % bs for p in range(c)]
        slots_old += slots[:old[b]]
        slots_new += slots[old[b]:]
    k_old, v_old = (torch.randn(len(slots_old), hk, d, generator=g).to(dtype) for _ in range(2))
    pa.store_kv_ref(k_old, v_old, cache, torch.tensor(slots_old, dtype=torch.int64), *scales)
    k_new, v_new = (torch.randn(len(slots_new), hk, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return dict(q=to(q), cache=to(cache), tables=to(tables), ctx=to(torch.tensor(ctx_lens, dtype=torch.int32)),
                qsl=to(qsl), k=to(k_new), v=to(v_new), slots=to(torch.tensor(slots_new, dtype=torch.int64)),
                scales=tuple(to(s) if isinstance(s, torch.Tensor) else s for s in scales))


DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
SHAPES = dict(hq=32, hk=8, d=128, bs=16) if DEVICE == "cuda" else dict(hq=4, hk=2, d=32, bs=4)
LONG_CONTEXT = pa.long_context(1)  # keys past which batch 1 takes the long-context splits
LONG = 3000 if DEVICE == "cuda" else 150


@pytest.mark.parametrize("fp8", [False, True])
def test_store_kv_matches_reference(fp8):
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    c = make_case([9, 5], [9, 5], dtype=DTYPE, kv_dtype=kv_dtype, seed=1, **SHAPES)
    ref = c["cache"].clone()
    slots = c["slots"].clone()
    slots[3] = -1  # a padded row: skipped
    pa.store_kv_ref(c["k"], c["v"], ref, slots, *c["scales"])
    pa.store_kv(c["k"], c["v"], c["cache"], slots, *c["scales"])
    if fp8 and interpreting():  # the interpreter mis-rounds ~2 % of fp32->fp8 casts (ENV.md)
        differ = (c["cache"].view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
        assert differ < 0.05
    else:
        assert torch.equal(c["cache"].view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_matches_reference(fp8, splits):
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    ctx = [1, 17, LONG, 64]
    c = make_case(ctx, [1] * len(ctx), dtype=DTYPE, kv_dtype=kv_dtype, seed=2, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["tables"], c["ctx"], 0.125, *c["scales"])
    out = pa.paged_decode(*args, num_splits=splits)
    ref = pa.paged_decode_ref(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [8, 40])
@pytest.mark.parametrize("fused", [True, False])
def test_decode_idle_splits_match_reference(fp8, splits, fused, monkeypatch):
    """More splits than a context fills: the idle ones write nothing (their partial rows stay uninitialized) and the
    combine merges only the splits that ran: in the decode launch's last split to arrive (fused), or in the combine
    kernel, here 2 partial rows at a time (several passes, the last one masked)."""
    monkeypatch.setattr(tuning, "_OVERRIDE", [dataclasses.replace(
        tuning.current(), decode_combine_rows=2, decode_fused_combine_max_pairs=1 << 16 if fused else 0)])
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    ctx = [1, 17, LONG, 64, 33]
    c = make_case(ctx, [1] * len(ctx), dtype=DTYPE, kv_dtype=kv_dtype, seed=7, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["tables"], c["ctx"], 0.125, *c["scales"])
    out = pa.paged_decode(*args, num_splits=splits,
                          variant=_variant_for_device(pa.decode_variant(len(ctx), SHAPES["hk"], fp8)))
    assert rel_err(out, pa.paged_decode_ref(*args)) < 1e-2


def test_decode_splits_policy():
    """Shapes only, plus one bit of the longest context: more splits past long_context(batch), for batches that
    split at all (Llama-8B's 8 KV heads; the figures behind the values: lowbit/kernels/tuning/sm90.py)."""
    long = LONG_CONTEXT + 1
    assert [pa.decode_splits(b, 8) for b in (1, 4, 16, 32, 64)] == [16, 9, 3, 2, 1]
    assert [pa.decode_splits(b, 8, long) for b in (1, 4, 16, 32, 64)] == [64, 16, 4, 2, 1]
    assert pa.decode_splits(1, 8, LONG_CONTEXT) == 16  # up to LONG_CONTEXT keys: as before
    # the long count starts earlier for larger batches: past 3072 keys up to batch 3, 1024 up to 6, 512 above
    assert [pa.decode_splits(b, 8, 2048) for b in (3, 4, 6, 8)] == [11, 16, 11, 8]
    assert [pa.decode_splits(b, 8, 1024) for b in (4, 6, 8)] == [9, 6, 8]
    assert pa.decode_splits(16, 8, 512) == 3 and pa.decode_splits(16, 8, 513) == 4


def test_backend_picks_splits_from_the_longest_decode_context(monkeypatch):
    """TritonAttentionBackend.attend: decode_splits of the decode rows' count and their longest context (host
    lengths), for a decode step and for the leading one-token rows of a mixed step (the prefill rows don't count)."""
    from lowbit.serve.layers import triton_attention
    from lowbit.serve.runner.context import StepContext

    seen = []
    fake_decode = lambda q, *a, num_splits=None, **kw: seen.append(num_splits) or q  # noqa: E731
    monkeypatch.setattr(pa, "paged_decode", fake_decode)
    if hasattr(triton_attention, "paged_decode"):  # the backend imports it by name (from lowbit.kernels)
        monkeypatch.setattr(triton_attention, "paged_decode", fake_decode)
    monkeypatch.setattr(triton_attention, "paged_prefill", lambda q, *a, **kw: q.clone())
    cache = torch.zeros(2, 1, 16, 8, 4)  # [2, blocks, block size, 8 KV heads, D]: only its KV-head count is read
    long = LONG_CONTEXT + 100
    for ctx_lens, q_lens, decode in (([5], [1], True), ([long], [1], True), ([5, long], [1, 1], True),
                                     ([5, 9, long], [1, 1, 700], False)):
        b = len(ctx_lens)
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        step = StepContext(positions=None, slot_mapping=None, query_start_loc=qsl,
                           context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                           block_tables=torch.zeros(b, 1, dtype=torch.int32), logits_indices=None, is_decode=decode,
                           query_lens_cpu=q_lens, context_lens_cpu=ctx_lens)
        triton_attention.TritonAttentionBackend.attend(torch.zeros(sum(q_lens), 32, 4), cache, step, 0.1, None, None)
    assert seen == [pa.decode_splits(1, 8), pa.decode_splits(1, 8, long), pa.decode_splits(2, 8, long),
                    pa.decode_splits(2, 8)]  # the mixed step's long context belongs to its prefill row
    assert seen[1] > seen[0] and seen[2] > seen[3]


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_and_extend_match_reference(fp8):
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    ctx, qlen = [70, 5, 33, LONG // 3], [70, 5, 9, 1]  # whole prompts, a chunk after cached tokens, a decode
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=kv_dtype, seed=3, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125, *c["scales"])
    out = paged_prefill(*args)
    ref = pa.paged_prefill_ref(*args)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_output_for_the_next_linear(splits):
    """With out_scale, decode and prefill write their own model-dtype output quantized to FP8 (out / out_scale): bit
    for bit what quantizing that output afterwards gives (the bf16 output itself is checked against the reference
    by the tests above); the references do the same on their own output."""
    from lowbit.kernels.ops.norm import quantize_fp8_ref

    ctx, qlen = [70, 5, 33], [70, 5, 1]
    c = make_case(ctx, qlen, dtype=DTYPE, kv_dtype=torch.float8_e4m3fn, seed=4, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    out_scale = torch.tensor(0.01, device=c["q"].device)
    args = (c["q"], c["cache"], c["qsl"], c["ctx"], c["tables"], max(qlen), 0.125, *c["scales"])
    d = make_case(ctx, [1] * 3, dtype=DTYPE, kv_dtype=torch.float8_e4m3fn, seed=5, **SHAPES)
    pa.store_kv_ref(d["k"], d["v"], d["cache"], d["slots"], *d["scales"])
    dargs = (d["q"], d["cache"], d["tables"], d["ctx"], 0.125, *d["scales"])
    pairs = [(paged_prefill(*args, out_scale), paged_prefill(*args)),
             (pa.paged_decode(*dargs, num_splits=splits, out_scale=out_scale),
              pa.paged_decode(*dargs, num_splits=splits)),
             (pa.paged_prefill_ref(*args, out_scale), pa.paged_prefill_ref(*args)),
             (pa.paged_decode_ref(*dargs, out_scale=out_scale), pa.paged_decode_ref(*dargs))]
    for fp8, plain in pairs:
        assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == plain.shape
        differ = (fp8.view(torch.uint8) != quantize_fp8_ref(plain, out_scale).view(torch.uint8)).float().mean()
        # the interpreter mis-rounds ~2 % of fp32 -> fp8 casts (ENV.md); compiled, the epilogue is exact
        assert differ.item() < 0.05 if interpreting() else differ.item() == 0


def _variant_for_device(v):
    """Interpreter shapes (block size 4, contexts up to 150): 32-token tiles, so the loops run several tiles."""
    return v if DEVICE == "cuda" else v._replace(block_n=min(v.block_n, 32))


@pytest.mark.parametrize("name", list(tuning.current().decode_variants))
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_variants_match_reference(name, fp8, splits):
    variant = _variant_for_device(tuning.current().decode_variants[name])
    ctx = [1, 17, LONG, 64]  # a 1-token context: with 3 splits two of its splits are empty
    kv_dtype = torch.float8_e4m3fn if fp8 else DTYPE
    c = make_case(ctx, [1] * len(ctx), dtype=DTYPE, kv_dtype=kv_dtype, seed=6, **SHAPES)
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["tables"], c["ctx"], 0.125, *c["scales"])
    if fp8 and not variant.blocks:  # an FP8 cache's V is stored transposed per block: read block by block only
        with pytest.raises(ValueError, match="block by block"):
            pa.paged_decode(*args, num_splits=splits, variant=variant)
        return
    out = pa.paged_decode(*args, num_splits=splits, variant=variant)
    assert rel_err(out, pa.paged_decode_ref(*args)) < 1e-2


def test_fp8_cache_stores_v_transposed_per_block():
    """An FP8 cache holds V as [blocks, Hk, D, block_size]; v_blocks reads it back in token order; K stays
    token-major. A bf16 cache stores both token-major."""
    for kv_dtype in (torch.float8_e4m3fn, DTYPE):
        c = make_case([5, 9], [5, 9], dtype=DTYPE, kv_dtype=kv_dtype, seed=3, **SHAPES)
        pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
        cache = pa._bits(c["cache"])  # float8 has no indexing kernels on the CPU: compare the bytes
        nb, bs, hk, d = cache.shape[1:]
        blk, off = c["slots"] // bs, c["slots"] % bs
        v_stored = cache[1].view(nb, hk, d, bs)[blk, :, :, off] if kv_dtype != DTYPE else cache[1][blk, off]
        v_want, k_want = (pa._bits(pa._quantize(x, s, kv_dtype)) for x, s in zip((c["v"], c["k"]), c["scales"][::-1]))
        assert torch.equal(v_stored, v_want)
        assert torch.equal(pa._bits(pa.v_blocks(c["cache"]))[blk, off], v_want)
        assert torch.equal(cache[0][blk, off], k_want)


def test_decode_variant_depends_on_shapes_only():
    """One choice per (batch, KV heads, cache dtype): a CUDA graph captured at a batch size stays valid."""
    assert pa.decode_variant(1, 8, True) == tuning.current().decode_variants["blk64w2s3"]  # split context
    assert pa.decode_variant(64, 8, True) == tuning.current().decode_variants["blk64w2s3"]
    assert pa.decode_variant(255, 8, True) == tuning.current().decode_variants["blk64w2s3"]
    assert pa.decode_variant(256, 8, True) == tuning.current().decode_variants["blk32w2s3"]  # the grid fills the card
    assert pa.decode_variant(512, 8, True) == tuning.current().decode_variants["blk32w2s3"]
    assert pa.decode_variant(512, 8, False) == tuning.current().decode_variants["rows64"]


def test_fp8_decode_tiles_hold_whole_blocks():
    """A cache block larger than the variant's tile: the FP8 decode widens the tile to one block (same result)."""
    c = make_case([1, 40, 9], [1, 1, 1], dtype=DTYPE, kv_dtype=torch.float8_e4m3fn, seed=2,
                  **{**SHAPES, "bs": 2 * SHAPES["bs"]})
    pa.store_kv_ref(c["k"], c["v"], c["cache"], c["slots"], *c["scales"])
    args = (c["q"], c["cache"], c["tables"], c["ctx"], 0.125, *c["scales"])
    variant = pa.DecodeVariant(SHAPES["bs"], 2, 1, blocks=True)  # tiles of half a cache block
    assert rel_err(pa.paged_decode(*args, variant=variant), pa.paged_decode_ref(*args)) < 1e-2
