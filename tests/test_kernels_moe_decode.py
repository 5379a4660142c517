"""The MoE decode path (lowbit.kernels.moe.decode: gate/up with SiLU, down with the combine) and the one-launch router
(lowbit.kernels.moe.route.router_topk) under the Triton interpreter against their torch references, and their rows in
the routing table."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import routes, tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.decode import down_combine, gate_up_silu  # noqa: E402
from lowbit.kernels.moe.fused_moe import combine_ref, expert_linear_ref, fused_moe_ref, fused_moe_triton  # noqa: E402
from lowbit.kernels.moe.route import moe_router_ref, router_topk  # noqa: E402
from lowbit.kernels.ops.activation import silu_and_mul_ref  # noqa: E402
from test_kernels_moe import TOL, problem  # noqa: E402
from test_kernels_moe_fp8 import INTERPRETER_NORM_TOL, fp8_problem, on_grid  # noqa: E402
from test_kernels_moe_route import assert_same_route  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")
SMALL_STEPS = (16, 512, 1)  # (BLOCK_N, step bytes, warps): 128 fp32 / 256 fp16 elements per K step


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,top_k", [(1, 2), (3, 3), (4, 1)])
def test_decode_path_matches_reference(dtype, t, top_k):
    """The whole path through fused_moe_triton, with the default tiles (one masked K step at these sizes)."""
    x, w13, w2, ids, weights = problem(t, 48, 40, 6, top_k, dtype, seed=10 + t)
    out = fused_moe_triton(x, w13, w2, ids, weights, path="moe_decode")
    ref = fused_moe_ref(x, w13, w2, ids, weights)
    assert out.dtype == dtype and out.shape == x.shape
    assert (out.float() - ref.float()).abs().max() <= TOL[dtype] * ref.float().abs().max()


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernels_over_several_k_steps(dtype):
    """K of 2-3 steps with a ragged last one, N not a multiple of BLOCK_N: each projection against its reference
    (gate/up: the per-pair GEMV rounded, then silu_and_mul; down: each pair's row rounded, then the combine)."""
    t, top_k, hidden, inter = 2, 2, 300, 270
    x, w13, w2, ids, weights = problem(t, hidden, inter, 5, top_k, dtype, seed=2)
    flat = ids.reshape(-1).tolist()
    act = gate_up_silu(x, w13, ids, top_k, config=SMALL_STEPS)
    want = torch.cat([silu_and_mul_ref(expert_linear_ref(x[i // top_k:i // top_k + 1].float(), w13.float(), e)
                                       .to(dtype)) for i, e in enumerate(flat)])
    assert act.shape == (t * top_k, inter)
    assert (act.float() - want.float()).abs().max() <= TOL[dtype] * want.float().abs().max()
    out = down_combine(act, w2, ids, weights, config=SMALL_STEPS)
    rows = torch.cat([expert_linear_ref(act[i:i + 1].float(), w2.float(), e).to(dtype) for i, e in enumerate(flat)])
    want = combine_ref(rows, weights)
    assert (out.float() - want.float()).abs().max() <= TOL[dtype] * want.float().abs().max()


@interpreter_only
@pytest.mark.parametrize("projection", ["gate_up", "down"])
def test_fp8_decode_kernels_match_reference_exactly(projection):
    """Inputs on each expert's fp8 grid (which the interpreter casts exactly), power-of-two input scales that differ
    by expert: each pair must use its own expert's input scale and per-row weight scales, to fp32 rounding."""
    t, k, experts = 4, 3, 6
    x, w13, w2, ids, weights, scales, _ = fp8_problem(t, 96, 48, experts, k, seed=4)
    a_scale = 2.0 ** (torch.arange(experts) % 3 - 6.0)
    flat = ids.reshape(-1).tolist()
    if projection == "gate_up":  # x on the coarsest grid lies on every expert's
        a = on_grid(x, a_scale.max())
        out = gate_up_silu(a, w13, ids, k, scales.w13_scale, a_scale)
        ref = torch.cat([silu_and_mul_ref(expert_linear_ref(a[i // k:i // k + 1], w13, e, scales.w13_scale, a_scale))
                         for i, e in enumerate(flat)])
    else:  # one row per pair, on its own expert's grid
        a = on_grid(torch.randn(t * k, 48), a_scale[ids.reshape(-1)][:, None])
        out = down_combine(a, w2, ids, weights, scales.w2_scale, a_scale)
        ref = combine_ref(torch.cat([expert_linear_ref(a[i:i + 1], w2, e, scales.w2_scale, a_scale)
                                     for i, e in enumerate(flat)]), weights)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@interpreter_only
def test_fp8_decode_path_near_reference():
    """Both FP8 projections, an unrouted expert; the activation between them is off the fp8 grid (the interpreter's
    cast errs there): a norm tolerance that quantizing at the layer's largest input scales misses by far."""
    x, w13, w2, ids, weights, scales, _ = fp8_problem(5, 96, 48, 6, 2, seed=7, skip_expert=2)
    out = fused_moe_triton(x, w13, w2, ids, weights, fp8=scales, path="moe_decode")
    ref = fused_moe_ref(x, w13, w2, ids, weights, fp8=scales)
    shared = scales._replace(a13_scale=scales.a13_scale.max().expand(6), a2_scale=scales.a2_scale.max().expand(6))
    wrong = fused_moe_ref(x, w13, w2, ids, weights, fp8=shared)
    assert (out - ref).norm() <= INTERPRETER_NORM_TOL * ref.norm() < (wrong - ref).norm()


def test_decode_refuses_half_the_fp8_scales():
    x, w13, w2, ids, weights, scales, _ = fp8_problem(1, 32, 16, 3, 1)
    with pytest.raises(ValueError, match="both w_scale"):
        gate_up_silu(x, w13, ids, 1, scales.w13_scale, None)


@interpreter_only
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts,top_k,hidden,dtype", [(128, 8, 96, torch.bfloat16), (60, 4, 300, torch.float16),
                                                        (6, 3, 40, torch.float32)])
def test_router_topk_matches_reference(experts, top_k, hidden, dtype, renormalize):
    """Logits to fp32-sum rounding, the experts as the top-k of the kernel's own logits; twice in a row, so the
    arrival counter must be zero again after each launch (else the second launch never picks)."""
    g = torch.Generator().manual_seed(experts)
    x = torch.randn(1, hidden, generator=g).to(dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(dtype)
    _, _, want_logits = moe_router_ref(x, w, top_k, renormalize)
    for _ in range(2):
        weights, ids, logits = router_topk(x, w, top_k, renormalize, config=SMALL_STEPS)
        assert logits.dtype == dtype and logits.shape == (1, experts)
        assert (logits.float() - want_logits.float()).abs().max() <= 1e-2 * want_logits.float().abs().max()
        assert_same_route(weights, ids, logits, top_k, renormalize)
    from lowbit.kernels.moe.route import _COUNTERS
    assert _COUNTERS[x.device].item() == 0


def test_router_topk_refuses_more_than_one_token():
    with pytest.raises(ValueError, match="one token"):
        router_topk(torch.zeros(2, 8), torch.zeros(4, 8), 2, True)


def test_routes_send_decode_experts_and_routers_to_the_fused_kernels():
    with tuning.override(moe_decode_max_pairs=64, moe_router_topk_max_tokens=1):
        check_fused_routes()
    off = [routes.route("moe", "fp8", 8, 1536, 2048, (9, 0)), routes.route("moe_router", "dense", 1, 128, 2048, (9, 0))]
    assert off == ["moe_gemv", "linear_then_route"]  # the tables' values: off (lowbit/kernels/tuning/sm90.py)


def check_fused_routes():
    hopper = (9, 0)
    for kind in ("dense", "fp8"):
        assert routes.route("moe", kind, 8, 1536, 2048, hopper) == "moe_decode"
    assert routes.route("moe", "fp8", 8, 1536, 2048, hopper, scale="per_token") == "moe_gemv"  # fp8_dynamic
    for kind in ("int8", "int4", "nvfp4"):
        assert routes.route("moe", kind, 8, 1536, 2048, hopper) == "moe_gemv"
    assert routes.route("moe", "fp8", 8, 1536, 2048, None) != "moe_decode"  # no GPU: no kernel
    assert routes.route("moe_router", "dense", 1, 128, 2048, hopper) == "router_topk"
    assert routes.route("moe_router", "dense", 2, 128, 2048, hopper) == "linear_then_route"
    assert routes.route("moe_router", "dense", 1, 128, 2048, None) == "linear_then_route"
