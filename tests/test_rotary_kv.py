"""Rotary fused into the KV store: the Triton kernel (CPU interpreter) against rotary_qk_ref + store_kv_ref, and the
attention backends' rotary_store_kv against each other."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels.attention import paged_attention as pa  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.ops.rotary import rotary_qk_ref  # noqa: E402
from lowbit.kernels.attention.rotary_kv import rotary_store_kv, rotary_store_kv_ref  # noqa: E402
from lowbit.serve.layers.attention import TorchAttentionBackend  # noqa: E402
from lowbit.serve.layers.triton_attention import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(),
                                reason="needs a GPU or the Triton interpreter (TRITON_INTERPRET=1 before triton)")
HQ, HK, D, BS = (32, 8, 128, 16) if DEVICE == "cuda" else (4, 2, 32, 4)
FP8 = torch.float8_e4m3fn


def make_case(dtype, kv_dtype, scaled, seed=0, t=7, blocks=6, hq=HQ, hk=HK):
    """qkv rows strided (2 spare columns, as a biased or padded projection might leave), a cache holding random
    earlier contents, shuffled slots with row 3 padded (-1)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hk) * D + 2, generator=g).to(dtype)[:, :(hq + 2 * hk) * D]
    positions = torch.randint(0, 64, (t,), generator=g)
    freqs = torch.arange(64.0)[:, None] * (10000.0 ** (-torch.arange(0, D, 2) / D))[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    part_scales = torch.tensor([1.3, 0.37, 2.9]) if scaled else None
    fp8 = kv_dtype == FP8
    scales = (torch.tensor(0.02), torch.tensor(0.03)) if fp8 else (torch.tensor(1.0), torch.tensor(1.0))
    cache = (torch.randn(2, blocks, BS, hk, D, generator=g) * (0.02 if fp8 else 1.0)).to(kv_dtype)
    slots = torch.randperm(blocks * BS, generator=g)[:t]
    slots[3] = -1
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return [to(qkv), hq, hk, to(positions), to(cos_sin), to(part_scales), to(cache), to(slots), to(scales[0]),
            to(scales[1])]


def assert_same_result(q, cache, q_ref, cache_ref):
    """q and a model-dtype cache within one rounding of the reference (the GPU may contract x1 cos - x2 sin into an
    FMA, the interpreter truncates fp32 -> bf16); FP8 values at most one e4m3 step apart (in the interpreter, which
    mis-rounds ~2 % of fp32 -> fp8 casts (ENV.md): under 5 % of the entries differ)."""
    torch.testing.assert_close(q, q_ref)
    if cache.dtype != FP8:
        torch.testing.assert_close(cache, cache_ref)
        return
    a, b = cache.float(), cache_ref.float()
    if interpreting():
        assert (a != b).float().mean().item() < 0.05
    else:  # one e4m3 step (3 mantissa bits; subnormals 2^-9)
        torch.testing.assert_close(a, b, rtol=0.125, atol=2.0**-9)


def run_both(case):
    """-> (q, cache) of the kernel and of the reference, each on its own copy of the cache."""
    ref_case, ker_case = list(case), list(case)
    ref_case[6], ker_case[6] = case[6].clone(), case[6].clone()
    return (rotary_store_kv(*ker_case), ker_case[6]), (rotary_store_kv_ref(*ref_case), ref_case[6])


CASES = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, FP8), (torch.bfloat16, FP8)]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype,kv_dtype", CASES)
def test_rotary_store_kv_matches_reference(dtype, kv_dtype, scaled):
    case = make_case(dtype, kv_dtype, scaled)
    (q, cache), (q_ref, cache_ref) = run_both(case)
    assert q.shape == (7, HQ * D) and q.dtype == dtype
    assert_same_result(q, cache, q_ref, cache_ref)
    assert not torch.equal(cache_ref.view(torch.uint8), case[6].view(torch.uint8))  # something was stored


@pytest.mark.parametrize("kv_dtype", [torch.float16, FP8])
def test_heads_split_over_programs(kv_dtype):
    """More heads than one program takes (16): q, k and v heads of one row in several programs."""
    case = make_case(torch.float16, kv_dtype, scaled=True, seed=4, hq=4 * HQ, hk=2 * HK)
    (q, cache), (q_ref, cache_ref) = run_both(case)
    assert case[1] + 2 * case[2] > 16 and q.shape == (7, 4 * HQ * D)
    assert_same_result(q, cache, q_ref, cache_ref)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
def test_reference_is_rotary_qk_then_store_kv(kv_dtype):
    """Bit for bit what the unfused path stores, padded row skipped, part_scales applied to q, k and v."""
    case = make_case(torch.bfloat16, kv_dtype, scaled=True, seed=1)
    qkv, hq, hk, pos, cos_sin, ps, cache, slots, ks, vs = case
    expected = cache.clone()
    q_exp, k, v = rotary_qk_ref(qkv, hq, hk, pos, cos_sin, ps)
    pa.store_kv_ref(k.view(-1, hk, D), v.view(-1, hk, D), expected, slots, ks, vs)
    got = cache.clone()
    q = rotary_store_kv_ref(qkv, hq, hk, pos, cos_sin, ps, got, slots, ks, vs)
    assert torch.equal(q, q_exp) and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    unscaled = cache.clone()
    rotary_store_kv_ref(qkv, hq, hk, pos, cos_sin, None, unscaled, slots, ks, vs)
    for half in (0, 1):  # the ratios 0.37 (k) and 2.9 (v) reached the cache
        assert not torch.equal(unscaled[half].view(torch.uint8), got[half].view(torch.uint8))


def test_padded_row_leaves_the_cache_alone():
    case = make_case(torch.float16, torch.float16, scaled=False, seed=2)
    case[7] = torch.full_like(case[7], -1)
    (q, cache), (q_ref, _) = run_both(case)
    assert torch.equal(cache, case[6])
    torch.testing.assert_close(q, q_ref)


@pytest.mark.parametrize("kv_dtype", [torch.float16, FP8])
def test_backends_agree(kv_dtype):
    case = make_case(torch.float16, kv_dtype, scaled=True, seed=3)
    case[7] = case[7].abs()  # the torch backend's store_kv takes no padded rows
    outs = []
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        c = list(case)
        c[6] = case[6].clone()
        outs.append((backend.rotary_store_kv(*c), c[6]))
    (q_t, cache_t), (q_k, cache_k) = outs
    assert_same_result(q_k.cpu(), cache_k.cpu(), q_t.cpu(), cache_t.cpu())


def norm_case(case, seed=5, gemma=False):
    """Per-head q/k RMSNorm weights (Qwen3's; Gemma's 1 + weight in float32) on the case's device."""
    g = torch.Generator().manual_seed(seed)
    q_w, k_w = (1 + 0.5 * torch.randn(D, generator=g) for _ in range(2))
    if not gemma:
        q_w, k_w = q_w.to(case[0].dtype), k_w.to(case[0].dtype)
    return (q_w.to(DEVICE), k_w.to(DEVICE), 1e-6)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype,kv_dtype", CASES)
def test_qk_norm_fused_matches_reference(dtype, kv_dtype, gemma):
    case = make_case(dtype, kv_dtype, scaled=False, seed=6)
    norm = norm_case(case, gemma=gemma)
    ref_case, ker_case = list(case), list(case)
    ref_case[6], ker_case[6] = case[6].clone(), case[6].clone()
    q, q_ref = rotary_store_kv(*ker_case, qk_norm=norm), rotary_store_kv_ref(*ref_case, qk_norm=norm)
    if dtype == torch.bfloat16:  # three bf16 roundings before the rotation (the interpreter truncates): where one
        # lands an ulp apart, x1 cos - x2 sin can cancel down to that ulp; a wrong weight or head is off by O(1)
        torch.testing.assert_close(q, q_ref, rtol=2 ** -6, atol=2 ** -5)
        if kv_dtype == dtype:
            torch.testing.assert_close(ker_case[6], ref_case[6], rtol=2 ** -6, atol=2 ** -5)
    else:
        assert_same_result(q, ker_case[6], q_ref, ref_case[6])
    plain = rotary_store_kv_ref(*[c.clone() if torch.is_tensor(c) else c for c in case])
    assert not torch.allclose(q_ref.float(), plain.float(), atol=1e-2)  # the norms changed q


def test_qk_norm_reference_is_the_unfused_path():
    """Bit for bit the path it replaces: q_norm / k_norm (rms_norm_ref per head), rotary_ref, then store_kv_ref."""
    from lowbit.kernels.ops.norm import rms_norm_ref
    from lowbit.kernels.ops.rotary import rotary_ref

    case = make_case(torch.bfloat16, FP8, scaled=False, seed=7)
    qkv, hq, hk, pos, cos_sin, _, cache, slots, ks, vs = case
    q_w, k_w, eps = norm_case(case)
    t = qkv.shape[0]
    q = rms_norm_ref(qkv[:, :hq * D].reshape(t, hq, D), q_w, eps)[0].reshape(t, -1)
    k = rms_norm_ref(qkv[:, hq * D:(hq + hk) * D].reshape(t, hk, D), k_w, eps)[0].reshape(t, -1)
    q, k = rotary_ref(q, k, pos, cos_sin)
    expected = cache.clone()
    pa.store_kv_ref(k.view(-1, hk, D), qkv[:, (hq + hk) * D:].reshape(t, hk, D), expected, slots, ks, vs)
    got = cache.clone()
    q_got = rotary_store_kv_ref(qkv, hq, hk, pos, cos_sin, None, got, slots, ks, vs, qk_norm=(q_w, k_w, eps))
    assert torch.equal(q_got, q) and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_qk_norm_refuses_part_scales():
    case = make_case(torch.float16, torch.float16, scaled=True, seed=8)
    with pytest.raises(ValueError, match="qk_norm takes no part_scales"):
        rotary_store_kv(*case, qk_norm=norm_case(case))


@pytest.mark.parametrize("kv_dtype", [torch.float16, FP8])
def test_backends_agree_with_qk_norm(kv_dtype):
    case = make_case(torch.float16, kv_dtype, scaled=False, seed=9)
    case[7] = case[7].abs()
    norm = norm_case(case)
    outs = []
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        c = list(case)
        c[6] = case[6].clone()
        outs.append((backend.rotary_store_kv(*c, qk_norm=norm), c[6]))
    (q_t, cache_t), (q_k, cache_k) = outs
    assert_same_result(q_k.cpu(), cache_k.cpu(), q_t.cpu(), cache_t.cpu())
