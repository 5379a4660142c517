"""Sliding-window attention and logit soft-capping in the torch reference (lowbit.kernels' attention_ref,
paged_prefill_ref / paged_decode_ref, and the CPU engine's TorchAttentionBackend) against transformers' own eager
attention (gemma2's eager_attention_forward) under transformers' own mask functions (masking_utils), for whole
prompts, chunked prefill and decode, bf16-free fp32 and FP8 caches, grouped-query heads."""
from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from lowbit.kernels.attention import paged_attention as pa
from lowbit.serve.layers.attention import Attention, TorchAttentionBackend
from lowbit.serve.runner.context import StepContext

HQ, HK, D, BS = 4, 2, 16, 4
SCALE = 0.3
SCALES = {False: (torch.tensor(1.0), torch.tensor(1.0)), True: (torch.tensor(0.02), torch.tensor(0.03))}


def hf_attention(q, k, v, first_pos, window, softcap):
    """transformers' eager attention of one sequence: q [n, Hq, D] at positions first_pos.., k, v [L, Hk, D] at
    0..L-1 -> [n, Hq, D], masked by masking_utils' (sliding window) causal mask function."""
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    qi = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    kj = torch.arange(k.shape[0])[None, :]
    allowed = fn(0, 0, qi, kj)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=HQ // HK, training=False, head_dim=D)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=SCALE, softcap=softcap)
    return out[0]


def pool(ctx_lens, fp8, seed=0):
    """Shuffled blocks holding every sequence's K/V: (cache, tables, per-sequence (k, v) as the cache returns them)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-c // BS) for c in ctx_lens]
    perm = torch.randperm(sum(nblk) + 2, generator=g)
    tables = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int32)
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[sum(nblk[:b]):sum(nblk[:b]) + n]
    cache = torch.zeros(2, sum(nblk) + 2, BS, HK, D, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
    slots = torch.tensor([int(tables[b, p // BS]) * BS + p % BS for b, c in enumerate(ctx_lens) for p in range(c)])
    k, v = (torch.randn(len(slots), HK, D, generator=g) for _ in range(2))
    pa.store_kv_ref(k, v, cache, slots, *SCALES[fp8])
    kvs = [pa.gather_kv(cache, tables[b], c, *SCALES[fp8], torch.float32) for b, c in enumerate(ctx_lens)]
    return cache, tables, kvs


def step(ctx_lens, q_lens, tables):
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return StepContext(positions=torch.zeros(sum(q_lens), dtype=torch.int64),
                       slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), query_start_loc=qsl,
                       context_lens=lens, block_tables=tables, logits_indices=torch.arange(len(q_lens)),
                       is_decode=all(n == 1 for n in q_lens), query_lens_cpu=list(q_lens),
                       context_lens_cpu=list(ctx_lens))


CASES = [  # (window, softcap)
    (5, None), (1, None), (8, 2.0), (None, 0.5), (100, None),
]
BATCHES = {  # (context lengths, new tokens each): whole prompts, chunks after a cached prefix, decodes
    "prefill": ([13, 22], [13, 22]), "chunked": ([19, 30], [6, 9]), "decode": ([3, 17, 40], [1, 1, 1]),
}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_reference_backend_and_kernel_references_equal_transformers(kind, window, softcap, fp8):
    ctx_lens, q_lens = BATCHES[kind]
    cache, tables, kvs = pool(ctx_lens, fp8)
    q = torch.randn(sum(q_lens), HQ, D, generator=torch.Generator().manual_seed(3))
    want, start = [], 0
    for (k, v), c, n in zip(kvs, ctx_lens, q_lens):
        want.append(hf_attention(q[start:start + n], k, v, c - n, window, softcap))
        start += n
    want = torch.cat(want)
    ctx = step(ctx_lens, q_lens, tables)
    got = TorchAttentionBackend.attend(q, cache, ctx, SCALE, *SCALES[fp8], sliding_window=window,
                                       logit_softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref = pa.paged_prefill_ref(q, cache, ctx.query_start_loc, ctx.context_lens, tables, max(q_lens), SCALE,
                               *SCALES[fp8], sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    if window is not None and window < min(ctx_lens):  # the window changes the answer: the test can see it
        plain = TorchAttentionBackend.attend(q, cache, ctx, SCALE, *SCALES[fp8], logit_softcap=softcap)
        assert (plain - want).abs().max() > 1e-3


@pytest.mark.parametrize("q_lens", [[1, 1], [3, 2]])
def test_window_never_reads_blocks_wholly_before_it(q_lens):
    """Blocks wholly before the first new query's window may be freed and reused: poisoning them changes nothing."""
    ctx_lens, window = [30, 21], 6
    cache, tables, _ = pool(ctx_lens, False)
    q = torch.randn(sum(q_lens), HQ, D, generator=torch.Generator().manual_seed(4))
    ctx = step(ctx_lens, q_lens, tables)
    before = TorchAttentionBackend.attend(q, cache, ctx, SCALE, *SCALES[False], sliding_window=window)
    for b, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        dead = (c - n - window + 1) // BS  # blocks [0, dead) end before the first query's window
        assert dead > 0
        cache[:, tables[b, :dead].long()] = float("nan")
    after = TorchAttentionBackend.attend(q, cache, ctx, SCALE, *SCALES[False], sliding_window=window)
    assert torch.isfinite(after).all() and torch.equal(before, after)


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(sliding_window=2.5), dict(logit_softcap=0.0),
                                 dict(logit_softcap=-1.0)])
def test_attention_refuses_bad_window_or_softcap(bad):
    with pytest.raises(ValueError, match="sliding_window|logit_softcap"):
        Attention(HQ, HK, D, **bad)


def test_attention_scale_defaults_to_head_dim():
    assert Attention(HQ, HK, D).scale == D ** -0.5
    assert Attention(HQ, HK, D, scale=0.1).scale == 0.1
