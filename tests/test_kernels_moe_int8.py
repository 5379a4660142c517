"""INT8 W8A8 (SmoothQuant) fused MoE: the torch reference against the W8A8_SQ_PER_CHANNEL format's own reference linear
per expert (each expert's pre_quant_scale and input scale), and the Triton grouped GEMMs and per-pair GEMVs (with and
without split K) under the interpreter against that reference."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.formats.w8a8_sq import W8A8_SQ_PER_CHANNEL as SQ  # noqa: E402
from lowbit.kernels import routes  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.fused_moe import Int8Scales, fused_moe_ref, fused_moe_triton  # noqa: E402
from lowbit.kernels.moe.gemv import expert_gemv_int8  # noqa: E402
from lowbit.kernels.moe.int8 import int8_linear_ref  # noqa: E402
from lowbit.kernels.ops.activation import silu_and_mul_ref  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to the output's largest magnitude


def int8_problem(t, hidden, inter, experts, top_k, dtype=torch.float32, seed=0):
    """x; per expert: SQ gate/up/down tensors as the format quantizes them, gate and up sharing a random smoothing
    and an input scale that differs from expert to expert (some clip x), down its own; routing as test_kernels_moe."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    parts = []
    for e in range(experts):
        smooth = (0.5 + torch.rand(hidden, generator=g)).to(dtype)
        gate = SQ.quantize(torch.randn(inter, hidden, generator=g) / hidden ** 0.5, smooth=smooth, x_amax=1.5 + 0.5 * e)
        up = SQ.quantize(2 * torch.randn(inter, hidden, generator=g) / hidden ** 0.5, smooth=smooth,
                         x_amax=1.5 + 0.5 * e)
        down = SQ.quantize(torch.randn(hidden, inter, generator=g) / inter ** 0.5,
                           smooth=(0.5 + torch.rand(inter, generator=g)).to(dtype), x_amax=0.2 + 0.1 * e)
        parts.append((gate, up, down))
    merged = [SQ.merge([gate, up]) for gate, up, _ in parts]
    w13, w2 = torch.stack([m["weight"] for m in merged]), torch.stack([d["weight"] for _, _, d in parts])
    stack = lambda ts, key: torch.stack([t[key].float().reshape(-1) for t in ts]).squeeze(-1)  # noqa: E731
    downs = [d for _, _, d in parts]
    scales = Int8Scales(stack(merged, "weight_scale"), stack(merged, "input_scale"), stack(merged, "pre_quant_scale"),
                        stack(downs, "weight_scale"), stack(downs, "input_scale"), stack(downs, "pre_quant_scale"))
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=g)
    return x, w13, w2, ids, weights, scales, parts


def per_expert_loop(x, ids, weights, parts):
    """Each (token, slot) through its expert's three SQ linears as the format's reference computes them."""
    out = torch.zeros_like(x)
    for tok in range(x.shape[0]):
        for j, e in enumerate(ids[tok].tolist()):
            gate, up, down = parts[e]
            xt = x[tok:tok + 1]
            h = silu_and_mul_ref(torch.cat([SQ.reference_linear(xt, gate), SQ.reference_linear(xt, up)], -1))
            out[tok] += weights[tok, j] * SQ.reference_linear(h, down)[0]
    return out


def test_int8_reference_equals_format_linears():
    x, w13, w2, ids, weights, scales, parts = int8_problem(9, 32, 24, 5, 2, seed=1)
    ref = fused_moe_ref(x, w13, w2, ids, weights, int8=scales)
    assert torch.allclose(ref, per_expert_loop(x, ids, weights, parts), atol=1e-5, rtol=0)


def test_int8_reference_uses_each_experts_smoothing():
    """Expert 0's smoothing for every expert gives another result: the test above catches it."""
    x, w13, w2, ids, weights, scales, parts = int8_problem(9, 32, 24, 5, 2, seed=1)
    shared = scales._replace(w13_smooth=scales.w13_smooth[:1].expand(5, -1))
    diff = fused_moe_ref(x, w13, w2, ids, weights, int8=shared) - per_expert_loop(x, ids, weights, parts)
    assert diff.abs().max() > 1e-3


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["moe_grouped", "moe_gemv"])
@pytest.mark.parametrize("t,top_k", [(1, 2), (13, 3)])
def test_int8_fused_matches_reference(dtype, path, t, top_k):
    x, w13, w2, ids, weights, scales, _ = int8_problem(t, 48, 40, 6, top_k, dtype, seed=t)
    out = fused_moe_triton(x, w13, w2, ids, weights, int8=scales, path=path)
    ref = fused_moe_ref(x, w13, w2, ids, weights, int8=scales)
    assert out.dtype == dtype and out.shape == x.shape
    assert (out.float() - ref.float()).abs().max() <= TOL[dtype] * ref.float().abs().max()


@interpreter_only
def test_int8_grouped_with_block_crossing_runs():
    """80 pairs over 4 experts: every expert's run spans two 16-row blocks."""
    x, w13, w2, ids, weights, scales, _ = int8_problem(40, 32, 16, 4, 2, seed=3)
    out = fused_moe_triton(x, w13, w2, ids, weights, int8=scales, path="moe_grouped")
    ref = fused_moe_ref(x, w13, w2, ids, weights, int8=scales)
    assert int(torch.bincount(ids.reshape(-1)).min()) > 16
    assert (out - ref).abs().max() <= TOL[torch.float32] * ref.abs().max()


@interpreter_only
@pytest.mark.parametrize("config", [(16, 32, 1, 1), (8, 16, 2, 3), (32, 64, 4, 2)])
def test_int8_gemv_tiles_and_split_k(config):
    """K = 80 is not a multiple of BLOCK_K: masked last steps; split 3 of 16-wide steps: ranges of 32, 32, 16."""
    x, w13, _, ids, _, s, _ = int8_problem(3, 80, 24, 4, 2, seed=7)
    out = expert_gemv_int8(x, w13, s.w13_scale, s.a13_scale, s.w13_smooth, ids, 2, config=config)
    ref = torch.stack([int8_linear_ref(x[i // 2:i // 2 + 1], w13, e, s.w13_scale, s.a13_scale, s.w13_smooth)[0]
                       for i, e in enumerate(ids.reshape(-1).tolist())])
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_moe_routes_take_int8():
    assert routes.route("moe", "int8", 8, 1536, 2048, (9, 0)) == "moe_gemv"
    assert routes.route("moe", "int8", 4096, 1536, 2048, (9, 0)) == "moe_grouped"
