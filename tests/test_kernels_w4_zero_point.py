"""Zero-point int4 (W4A16_ZP) on the W4 kernels (CPU interpreter, fp16 x: the interpreter's bf16 tl.dot is wrong):
the packed layout reads back the format's exact dequantization; the GEMV (M = 1, 2) and w4_mma (M <= 16) with zero
points in the kernel, and the other kernels plus the group-sum correction match x @ ((q - z) * s)^T in fp32 on every
route (M = 1 on the tensor-core kernel: folded into the bias; up to 16 rows: the in-place launch; more: addmm)."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit import formats  # noqa: E402
from lowbit.kernels import routes, tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear import w4_gemv, w4_mma, w4a16, w4_zero_point  # noqa: E402

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="needs triton and TRITON_INTERPRET=1 at its import")
# fp16 x and output: rounding the exact result to fp16 alone costs ~2e-4 relative; kernels plus correction measure
# ~2-3e-4 (operands in fp16, at most one more output rounding). Without the correction the error is ~0.6.
TOL = 1e-3


def zp_tensors(n: int, k: int, group: int, seed: int = 0) -> dict:
    """W4A16_ZP tensors: random codes, zero points 0..15 as AutoAWQ stores them (minus 8: lowbit's [-8, 7])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    zero = (torch.randint(0, 16, (n, k // group), generator=g) - 8).to(torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
    return {"weight": formats.pack_int4_rows(q), "weight_scale": scale, "weight_zero_point": zero}


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference(x, t, bias=None, smooth=None):
    """x @ W^T (+ bias) in fp32, W the format's exact dequantization, x * smooth rounded to x's dtype."""
    xs = x * smooth.to(x.dtype) if smooth is not None else x
    y = xs.float() @ formats.W4A16_ZP.dequantize(t).t()
    return y + bias.float() if bias is not None else y


@pytest.mark.parametrize("group", [32, 64, 128])
def test_pack_reads_back_the_exact_dequantization(group):
    t = zp_tensors(48, 256, group)
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], zero_point=t["weight_zero_point"])
    assert torch.equal(w4a16.dequantize_w4(packed), formats.W4A16_ZP.dequantize(t))


def test_routes_pick_the_correction_by_rows():
    picks = {m: routes.route("zero_point", "int4", m, 4096, 4096, None) for m in (1, 2, 16, 17, 4096)}
    assert picks == {1: "zp_gemv", 2: "zp_mma", 16: "zp_add", 17: "zp_addmm", 4096: "zp_addmm"}
    # the GEMV takes M = 2 where w4_mma does not (groups below 128)
    assert routes.route("zero_point", "int4", 2, 4096, 4096, None, group=64) == "zp_gemv"
    # with neither GEMV nor w4_mma at M = 1, the correction is folded into the kernel's bias
    with tuning.override(w4_gemv_max_m=0):
        assert routes.route("zero_point", "int4", 1, 4096, 4096, None) == "zp_bias"


# (M, K, N, group, smooth, bias, config): K ragged (not a multiple of BLOCK_K) and padded (not a multiple of 128)
GEMV_CASES = [
    (1, 2048, 64, 128, False, False, None),  # the default tile: one even step
    (1, 4096 + 640, 34, 64, True, True, None),  # 3 steps, the last one masked; N not a multiple of BLOCK_N
    (1, 3088, 18, 16, True, True, (4, 1024, 1)),  # groups of 16: two zero points per chunk; K padded to 3200
    (1, 992, 6, 32, False, True, (4, 2048, 1)),  # K padded to 1024, K < BLOCK_K
    (1, 2304, 20, 256, True, False, (4, 1024, 1)),  # groups of 256
    (2, 2048, 64, 128, False, True, None),
    (2, 4096 + 640, 34, 64, True, True, None),
    (2, 3088, 18, 16, True, False, (4, 1024, 1)),
]


@needs_interpreter
@pytest.mark.parametrize("m,k,n,group,smooth,bias,config", GEMV_CASES)
def test_gemv_subtracts_zero_points_in_the_kernel(m, k, n, group, smooth, bias, config):
    """w4_gemv with zero_point vs the format's exact dequantization, each row (TOL as the symmetric GEMV tests)."""
    t = zp_tensors(n, k, group, seed=k + n + m)
    g = torch.Generator().manual_seed(m + group)
    sm = (0.5 + torch.rand(k, generator=g)).half() if smooth else None
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], sm, t["weight_zero_point"])
    x = torch.randn(m, k, generator=g).half()
    b = torch.randn(n, generator=g).half() if bias else None
    ref = reference(x, t, b, sm)
    out = w4_gemv.w4_gemv(x, packed, b, config, zero_point=packed.zero_point)
    assert out.shape == (m, n) and out.dtype == torch.float16
    for row in range(m):
        assert rel_err(out[row], ref[row]) < TOL, (row, rel_err(out[row], ref[row]))
    assert rel_err(w4_gemv.w4_gemv(x, packed, b, config), ref) > 0.1  # without them: far off


# (M, K, N, group, x dtype, smooth, bias, config) as tests/test_kernels_w4_mma.py: TOL there per dtype (the
# interpreter truncates fp32 -> bf16)
MMA_TOL = {torch.float16: 1e-3, torch.bfloat16: 1.5e-2}
MMA_CASES = [
    (1, 768, 18, 128, torch.float16, False, True, (16, 256, 1)),  # N past the tile, the f16 path's two addends
    (3, 1024, 32, 128, torch.bfloat16, True, True, (16, 256, 2)),  # odd M, two warps
    (8, 1024, 48, 256, torch.float16, False, False, (16, 512, 1)),  # groups of 256
    (5, 896, 16, 128, torch.bfloat16, True, False, (32, 512, 2)),  # K ragged: masked x and zero points
    (16, 1024, 32, 128, torch.float16, True, True, (16, 512, 2)),  # two x tiles
]


@needs_interpreter
@pytest.mark.parametrize("m,k,n,group,dtype,smooth,bias,config", MMA_CASES)
def test_mma_subtracts_zero_points_in_the_kernel(m, k, n, group, dtype, smooth, bias, config):
    t = zp_tensors(n, k, group, seed=k + n + m)
    g = torch.Generator().manual_seed(m + group)
    sm = (0.5 + torch.rand(k, generator=g)).to(dtype) if smooth else None
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], sm, t["weight_zero_point"])
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = reference(x, t, b, sm)
    out = w4_mma.w4_mma(x, packed, b, config, zero_point=packed.zero_point)
    assert out.shape == (m, n) and out.dtype == dtype
    for row in range(m):
        assert rel_err(out[row], ref[row]) < MMA_TOL[dtype], (row, rel_err(out[row], ref[row]))
    assert rel_err(w4_mma.w4_mma(x, packed, b, config), ref) > 0.1  # without them: far off


@needs_interpreter
def test_gemv_route_runs_one_launch(monkeypatch):
    """w4a16_gemm at M = 1 on zero-point weights: the GEMV alone (no correction launch, no group sums)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a correction ran on the GEMV route")

    monkeypatch.setattr(w4_zero_point, "correct", forbidden)
    monkeypatch.setattr(w4_zero_point, "group_sums", forbidden)
    launches = []
    real = w4_gemv.w4_gemv
    monkeypatch.setattr(w4_gemv, "w4_gemv", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    t = zp_tensors(40, 512, 64, seed=11)
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], zero_point=t["weight_zero_point"])
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6)).half()
    assert rel_err(w4a16.w4a16_gemm(x, packed), reference(x, t)) < TOL
    assert launches == [1]


@needs_interpreter
@pytest.mark.parametrize("m", [1, 2, 7, 64])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_kernels_with_zero_points_match_the_reference(m, group):
    n, k = 48, 256
    t = zp_tensors(n, k, group, seed=m + group)
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], zero_point=t["weight_zero_point"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).half()
    bias = torch.randn(n, generator=g).half()
    ref = reference(x, t, bias)
    out = w4a16.w4a16_gemm(x, packed, bias)
    assert out.dtype == torch.float16 and out.shape == (m, n)
    assert rel_err(out, ref) < TOL, (m, group, rel_err(out, ref))
    # the correction matters: the symmetric kernel alone is far off
    assert rel_err(w4a16._symmetric_gemm(x, packed, bias), ref) > 0.1


@needs_interpreter
@pytest.mark.parametrize("m", [1, 3, 20])
def test_pre_quant_scale_enters_the_group_sums(m):
    n, k, group = 32, 384, 128  # K not a multiple of the kernels' 128-wide tiles' padding target
    t = zp_tensors(n, k, group, seed=7)
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], smooth, t["weight_zero_point"])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).half()
    assert rel_err(w4a16.w4a16_gemm(x, packed), reference(x, t, smooth=smooth)) < TOL


@needs_interpreter
@pytest.mark.parametrize("group", [64, 256])
def test_correction_launch_equals_torch(group):
    """The one-launch correction (bias form and in-place form) vs torch's fp32 group sums @ zs."""
    n, k = 40, 512
    t = zp_tensors(n, k, group, seed=5)
    packed = w4a16.pack_int4(t["weight"], t["weight_scale"], zero_point=t["weight_zero_point"])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, k, generator=g).half()
    bias = torch.randn(n, generator=g)
    c = w4_zero_point.correction_ref(x, None, packed.zero_scale, group)
    as_bias = w4_zero_point.correct(x[:1], packed, bias)
    assert as_bias.dtype == torch.float32
    torch.testing.assert_close(as_bias, bias - c[0], rtol=1e-5, atol=1e-5)
    y = torch.randn(3, n, generator=g)
    expected = y - c
    w4_zero_point.correct(x, packed, None, y)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
