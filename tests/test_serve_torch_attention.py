"""The CPU engine's attention backend (layers.attention.TorchAttentionBackend) against lowbit.kernels' references:
its batched decode SDPA (one call for sequences of different lengths, padded and masked) equals paged_decode_ref,
and its once-a-step slot / rotary tables store and rotate exactly as store_kv_ref and rotary_qk_ref."""
import pytest
import torch

from lowbit.kernels.attention import paged_attention as pa
from lowbit.kernels.ops.rotary import rotary_qk_ref
from lowbit.serve.layers.attention import TorchAttentionBackend
from lowbit.serve.layers.rotary import RotaryEmbedding
from lowbit.serve.runner.context import StepContext

HQ, HK, D, BS = 4, 2, 16, 4
SCALES = {False: (torch.tensor(1.0), torch.tensor(1.0)), True: (torch.tensor(0.02), torch.tensor(0.03))}


def pool(ctx_lens, fp8, seed=0):
    """A cache with shuffled blocks holding every sequence's K/V, its block tables, and each token's slot."""
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
    return cache, tables, slots


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("ctx_lens", [[1, 17, 40, 64], [23], [9, 9]])
def test_batched_decode_equals_the_per_sequence_reference(fp8, ctx_lens):
    cache, tables, _ = pool(ctx_lens, fp8)
    q = torch.randn(len(ctx_lens), HQ, D, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    ctx = StepContext(positions=lens.long() - 1, slot_mapping=torch.zeros(len(ctx_lens), dtype=torch.int64),
                      query_start_loc=torch.arange(len(ctx_lens) + 1, dtype=torch.int32), context_lens=lens,
                      block_tables=tables, logits_indices=torch.arange(len(ctx_lens)), is_decode=True,
                      query_lens_cpu=[1] * len(ctx_lens), context_lens_cpu=list(ctx_lens))
    out = TorchAttentionBackend.attend(q, cache, ctx, 0.25, *SCALES[fp8])
    ref = pa.paged_decode_ref(q, cache, tables, lens, 0.25, *SCALES[fp8])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    again = TorchAttentionBackend.attend(q, cache, ctx, 0.25, *SCALES[fp8])  # the step's tables, reused
    assert torch.equal(again, out)


@pytest.mark.parametrize("fp8", [False, True])
def test_rotary_store_kv_rotates_and_stores_exactly_as_the_references(fp8):
    ctx_lens = [5, 11]
    cache, _, slots = pool(ctx_lens, fp8)
    ref_cache = cache.clone()
    t = len(slots)
    qkv = torch.randn(t, (HQ + 2 * HK) * D, generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(c) for c in ctx_lens])
    cos_sin = RotaryEmbedding({"rope_theta": 10000.0}, D, 64).cos_sin_cache
    q = TorchAttentionBackend.rotary_store_kv(qkv, HQ, HK, positions, cos_sin, None, cache, slots, *SCALES[fp8])
    q_ref, k_ref, v_ref = rotary_qk_ref(qkv, HQ, HK, positions, cos_sin)
    pa.store_kv_ref(k_ref.view(t, HK, D), v_ref.reshape(t, HK, D), ref_cache, slots, *SCALES[fp8])
    assert torch.equal(q, q_ref)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


def test_store_kv_skips_negative_slots_as_the_reference():
    cache, _, slots = pool([6], False)
    ref_cache = cache.clone()
    slots = slots.clone()
    slots[2] = -1
    k, v = torch.ones(6, HK, D), torch.full((6, HK, D), 2.0)
    TorchAttentionBackend.store_kv(k, v, cache, slots, *SCALES[False])
    pa.store_kv_ref(k, v, ref_cache, slots, *SCALES[False])
    assert torch.equal(cache, ref_cache)
