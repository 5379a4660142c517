"""INT4 (W4A16 AWQ) fused MoE and the small-batch path: the torch reference against the format's own reference linear
per expert, the Triton grouped GEMM and the per-pair GEMV (INT4, 16-bit and FP8 experts) under the interpreter
against the reference, and the routes' MoE rows."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.formats.w4a16_awq import W4A16_AWQ  # noqa: E402
from lowbit.kernels import routes, tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from lowbit.kernels.moe.int4 import Int4Scales  # noqa: E402
from lowbit.kernels.ops.activation import silu_and_mul_ref  # noqa: E402
from test_kernels_moe import TOL, problem  # noqa: E402
from test_kernels_moe_fp8 import INTERPRETER_NORM_TOL, fp8_problem  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")
HOPPER = (9, 0)


def int4_problem(t, hidden, inter, experts, top_k, group, dtype=torch.float32, seed=0, smooth=True):
    """x; per expert: gate/up/down quantized by the format (gate and up share a pre_quant_scale, each expert its
    own), stacked as the loader stacks them; routing with every expert distinct per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    parts = []
    for _ in range(experts):
        s13 = 0.5 + torch.rand(hidden, generator=g) if smooth else None
        s2 = 0.5 + torch.rand(inter, generator=g) if smooth else None
        gate = W4A16_AWQ.quantize(torch.randn(inter, hidden, generator=g) / hidden ** 0.5, group=group, smooth=s13)
        up = W4A16_AWQ.quantize(2 * torch.randn(inter, hidden, generator=g) / hidden ** 0.5, group=group, smooth=s13)
        down = W4A16_AWQ.quantize(torch.randn(hidden, inter, generator=g) / inter ** 0.5, group=group, smooth=s2)
        parts.append((gate, up, down))
    ones = torch.ones
    w13 = torch.stack([torch.cat([gt["weight"], up["weight"]]) for gt, up, _ in parts])
    scales = Int4Scales(
        w13_scale=torch.stack([torch.cat([gt["weight_scale"], up["weight_scale"]]) for gt, up, _ in parts]),
        w13_smooth=torch.stack([gt.get("pre_quant_scale", ones(hidden)) for gt, _, _ in parts]),
        w2_scale=torch.stack([d["weight_scale"] for _, _, d in parts]),
        w2_smooth=torch.stack([d.get("pre_quant_scale", ones(inter)) for _, _, d in parts]))
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=g)
    return x, w13, torch.stack([d["weight"] for _, _, d in parts]), ids, weights, scales, parts


def per_expert_loop(x, ids, weights, parts):
    """Each (token, slot) through its expert's three linears as W4A16_AWQ's reference linear computes them."""
    out = torch.zeros_like(x)
    for tok in range(x.shape[0]):
        for j, e in enumerate(ids[tok].tolist()):
            gate, up, down = parts[e]
            xt = x[tok:tok + 1]
            h = silu_and_mul_ref(torch.cat([W4A16_AWQ.reference_linear(xt, gate),
                                            W4A16_AWQ.reference_linear(xt, up)], -1))
            out[tok] += weights[tok, j] * W4A16_AWQ.reference_linear(h, down)[0]
    return out


def test_int4_reference_equals_format_linears():
    x, w13, w2, ids, weights, scales, parts = int4_problem(9, 64, 32, 5, 2, group=32, seed=1)
    ref = fused_moe_ref(x, w13, w2, ids, weights, int4=scales)
    assert torch.allclose(ref, per_expert_loop(x, ids, weights, parts), atol=1e-5, rtol=0)


def close(out, ref, dtype):
    return (out.float() - ref.float()).abs().max() <= TOL[dtype] * ref.float().abs().max()


@interpreter_only
@pytest.mark.parametrize("path", ["moe_grouped", "moe_gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,group,inter,smooth", [(1, 32, 96, True), (6, 64, 128, True), (17, 16, 80, False)])
def test_int4_triton_matches_reference(path, dtype, t, group, inter, smooth):
    """hidden 128: two K steps of 64 (group 64) or several groups; N = 2 x 80 is not a multiple of BLOCK_N."""
    x, w13, w2, ids, weights, scales, _ = int4_problem(t, 128, inter, 6, 2, group, dtype, seed=t, smooth=smooth)
    out = fused_moe_triton(x, w13, w2, ids, weights, int4=scales, path=path)
    ref = fused_moe_ref(x, w13, w2, ids, weights, int4=scales)
    assert out.dtype == dtype and close(out, ref, dtype)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,top_k", [(1, 2), (3, 3)])
def test_dense_gemv_matches_reference(dtype, t, top_k):
    x, w13, w2, ids, weights = problem(t, 48, 40, 6, top_k, dtype, seed=t)
    out = fused_moe_triton(x, w13, w2, ids, weights, path="moe_gemv")
    assert close(out, fused_moe_ref(x, w13, w2, ids, weights), dtype)


@interpreter_only
def test_fp8_gemv_matches_reference():
    """As test_kernels_moe_fp8's grouped GEMM: compared by norm (the interpreter's fp8 cast)."""
    x, w13, w2, ids, weights, scales, _ = fp8_problem(4, 64, 48, 6, 2, seed=2)
    out = fused_moe_triton(x, w13, w2, ids, weights, fp8=scales, path="moe_gemv")
    ref = fused_moe_ref(x, w13, w2, ids, weights, fp8=scales)
    assert ((out - ref).norm() / ref.norm()).item() < INTERPRETER_NORM_TOL


@interpreter_only
def test_broken_int4_scales_fail():
    """The comparison catches a kernel that reads the wrong nibble's scale: swapping the halves of each scale pair."""
    x, w13, w2, ids, weights, scales, _ = int4_problem(6, 128, 96, 6, 2, 32, seed=4)
    swapped = scales.w13_scale.view(6, 96, 2, 4).flip(2).reshape(6, 192, 4)
    out = fused_moe_triton(x, w13, w2, ids, weights, int4=scales._replace(w13_scale=swapped), path="moe_gemv")
    assert not close(out, fused_moe_ref(x, w13, w2, ids, weights, int4=scales), torch.float32)


def test_moe_routes_pick_gemv_at_few_pairs():
    most = tuning.current().moe_gemv_max_pairs  # the table route() reads, per expert kind
    with tuning.override(moe_decode_max_pairs=0):  # without the fused decode path (test_kernels_moe_decode's)
        pick = [routes.route("moe", kind, pairs, 1536, 2048, HOPPER) for kind in routes.MOE_KINDS
                for pairs in (8, most[kind], most[kind] + 1)]
    assert pick == ["moe_gemv", "moe_gemv", "moe_grouped"] * len(routes.MOE_KINDS)
    with tuning.override(moe_gemv_max_pairs={**most, "int4": 8}):
        assert routes.route("moe", "int4", 16, 1536, 2048, HOPPER) == "moe_grouped"
    with pytest.raises(ValueError, match="no moe route"):  # every weight kind lowbit packs has one: a made-up kind
        routes.route("moe", "int2", 1, 1536, 2048, HOPPER)
