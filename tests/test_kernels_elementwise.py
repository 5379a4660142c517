"""RMSNorm(+residual), rotary and SiLU-and-mul: Triton kernels (CPU interpreter) against their torch references."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.ops.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from lowbit.kernels.ops.norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from lowbit.kernels.ops.rotary import rotary_qk_ref, rotary_ref, rotary_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the deferred-scale tests run on the GPU too
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreting(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@interpreter_only
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(with_residual):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 200, generator=g).half()
    res = torch.randn(6, 200, generator=g).half() if with_residual else None
    w = (1 + 0.1 * torch.randn(200, generator=g)).half()
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, ref) < 2e-3
    assert torch.equal(new_res, ref_res)


@interpreter_only
def test_rms_norm_ref_matches_hf_llama_formula():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16)
    var = x.float().pow(2).mean(-1, keepdim=True)
    hf = w * (x.float() * torch.rsqrt(var + 1e-5)).to(torch.bfloat16)
    out, res = rms_norm_ref(x, w, 1e-5)
    assert torch.equal(out, hf) and res is x


def _cos_sin_cache(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@interpreter_only
def test_rotary_ref_matches_hf_rotate_half():
    t, h, d = 5, 3, 16
    q = torch.randn(t, h, d)
    pos = torch.tensor([0, 3, 7, 1, 9])
    cache = _cos_sin_cache(16, d)
    cos = torch.cat([cache[pos, : d // 2]] * 2, dim=-1)[:, None]
    sin = torch.cat([cache[pos, d // 2:]] * 2, dim=-1)[:, None]
    rotate_half = torch.cat([-q[..., d // 2:], q[..., : d // 2]], dim=-1)
    q_out, _ = rotary_ref(q, q, pos, cache)
    assert torch.allclose(q_out, q * cos + rotate_half * sin, atol=1e-6)


@interpreter_only
def test_rotary_matches_reference_with_flat_and_3d_heads():
    g = torch.Generator().manual_seed(2)
    t, hq, hk, d = 7, 4, 2, 32
    q = torch.randn(t, hq * d, generator=g).half()
    k = torch.randn(t, hk, d, generator=g).half()
    pos = torch.randint(0, 64, (t,), generator=g)
    cache = _cos_sin_cache(64, d)
    q_out, k_out = rotary_triton(q, k, pos, cache)
    q_ref, k_ref = rotary_ref(q, k, pos, cache)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert rel_err(q_out, q_ref) < 2e-3 and rel_err(k_out, k_ref) < 2e-3


def test_rotary_qk_ref_reads_q_k_v_from_the_fused_rows():
    g = torch.Generator().manual_seed(4)
    t, hq, hk, d = 5, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).half()  # q | k | v per row, as the fused projection writes
    pos = torch.randint(0, 64, (t,), generator=g)
    cache = _cos_sin_cache(64, d)
    q_ref, k_ref, v_ref = rotary_qk_ref(qkv, hq, hk, pos, cache)
    assert q_ref.shape == (t, hq * d) and k_ref.shape == (t, hk * d)
    q_sep, k_sep = rotary_ref(qkv[:, :hq * d].contiguous(), qkv[:, hq * d:(hq + hk) * d].contiguous(), pos, cache)
    assert torch.equal(q_ref, q_sep) and torch.equal(k_ref, k_sep)
    assert torch.equal(v_ref, qkv[:, (hq + hk) * d:])


def _qkv_with_deferred_scales(g, t, hq, hk, d, dtype):
    """A merged layer's output whose k and v parts came out divided by their ratios, and those ratios [3]."""
    scales = torch.tensor([1.0, 0.37, 2.9])
    true = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    per_col = torch.cat([scales[i].expand(n * d) for i, n in enumerate([hq, hk, hk])])
    return true, (true / per_col).to(dtype), scales


@interpreter_only
def test_rotary_qk_part_scales_reference_equals_scaled_float_rotation():
    g = torch.Generator().manual_seed(6)
    t, hq, hk, d = 4, 4, 2, 16
    true, qkv, scales = _qkv_with_deferred_scales(g, t, hq, hk, d, torch.float32)
    pos = torch.randint(0, 32, (t,), generator=g)
    cache = _cos_sin_cache(32, d)
    q, k, v = rotary_qk_ref(qkv, hq, hk, pos, cache, scales)
    cos = torch.cat([cache[pos, : d // 2]] * 2, dim=-1)[:, None]  # independent: HF's rotate_half on the true values
    sin = torch.cat([cache[pos, d // 2:]] * 2, dim=-1)[:, None]
    for out, cols in [(q, true[:, :hq * d]), (k, true[:, hq * d:(hq + hk) * d])]:
        x = cols.reshape(t, -1, d)
        rotated = x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1) * sin
        assert torch.allclose(out, rotated.reshape(t, -1), atol=1e-5)
    assert torch.allclose(v, true[:, (hq + hk) * d:], atol=1e-5) and v.is_contiguous()


@interpreter_only
def test_silu_and_mul_matches_reference():
    x = torch.randn(2, 3, 2 * 1500, generator=torch.Generator().manual_seed(3)).half()
    out = silu_and_mul_triton(x)
    assert out.shape == (2, 3, 1500)
    assert rel_err(out, silu_and_mul_ref(x)) < 2e-3


@interpreter_only
def test_silu_and_mul_up_scale_reference_equals_float_formula():
    g = torch.Generator().manual_seed(9)
    gate, up = torch.randn(3, 200, generator=g), torch.randn(3, 200, generator=g)
    r = torch.tensor(0.3)
    out = silu_and_mul_ref(torch.cat([gate, up / r], dim=-1), up_scale=r)
    assert torch.allclose(out, gate * torch.sigmoid(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", [False, True])
def test_silu_and_mul_up_scale_kernel_matches_reference(quant):
    x = torch.randn(4, 2 * 1500, generator=torch.Generator().manual_seed(10)).half().to(DEVICE)
    up_scale = torch.tensor([2.7], device=DEVICE)
    scale = torch.tensor(3.0 / 448, device=DEVICE) if quant else None
    out, ref = silu_and_mul_triton(x, scale, up_scale), silu_and_mul_ref(x, scale, up_scale)
    assert out.shape == (4, 1500) and out.dtype == (torch.float8_e4m3fn if quant else x.dtype)
    if quant:  # the interpreter mis-rounds ~2% of fp32 -> fp8 casts (ENV.md); on a GPU this holds with margin
        assert (out.float() != ref.float()).float().mean() < 0.05 and rel_err(out, ref) < 0.1
    else:
        assert rel_err(out, ref) < 2e-3
    assert rel_err(ref, silu_and_mul_ref(x, scale)) > 0.5  # the scale matters at this tolerance


@interpreter_only
def test_norm_and_silu_fp8_epilogues_match_reference_quantization():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 256, generator=g).half()
    res = torch.randn(4, 256, generator=g).half()
    w = torch.rand(256, generator=g).half()
    scale = torch.tensor(3.0 / 448)
    out, _ = rms_norm_triton(x, w, 1e-6, res, scale)
    ref, _ = rms_norm_ref(x, w, 1e-6, res, scale)
    assert out.dtype == torch.float8_e4m3fn
    # the interpreter mis-rounds ~2% of fp32 -> fp8 casts (ENV.md): compare with a tolerance
    assert (out.float() != ref.float()).float().mean() < 0.05 and rel_err(out, ref) < 0.1
    gu = torch.randn(3, 2 * 300, generator=g).half()
    q = silu_and_mul_triton(gu, scale)
    q_ref = silu_and_mul_ref(gu, scale)
    assert q.dtype == torch.float8_e4m3fn and rel_err(q, q_ref) < 0.1
