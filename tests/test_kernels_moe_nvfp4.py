"""NVFP4 (weight-only) fused MoE: the torch reference against W4A16_NVFP4's own reference linear per expert, the
Triton grouped GEMM and per-pair GEMV under the interpreter against the reference, and a kernel reading swapped
block scales caught."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.formats.w4a16_nvfp4 import W4A16_NVFP4  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from lowbit.kernels.moe.nvfp4 import Nvfp4Scales, grouped_gemm_nvfp4  # noqa: E402
from lowbit.kernels.ops.activation import silu_and_mul_ref  # noqa: E402
from test_kernels_moe import TOL  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")


def nvfp4_problem(t, hidden, inter, experts, top_k, dtype=torch.float32, seed=0):
    """x; per expert: gate/up/down quantized by W4A16_NVFP4 (each its own weight_scale_2: gate's and up's differ),
    stacked as the loader stacks them (global scales repeated per output row); every expert distinct per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    parts = []
    for _ in range(experts):
        gate = W4A16_NVFP4.quantize(torch.randn(inter, hidden, generator=g) / hidden ** 0.5)
        up = W4A16_NVFP4.quantize(3 * torch.randn(inter, hidden, generator=g) / hidden ** 0.5)
        down = W4A16_NVFP4.quantize(torch.randn(hidden, inter, generator=g) / inter ** 0.5)
        parts.append((gate, up, down))
    rows = lambda p: p["weight_scale_2"].float().reshape(1).expand(p["weight"].shape[0])  # noqa: E731
    w13 = torch.stack([torch.cat([gt["weight"], up["weight"]]) for gt, up, _ in parts])
    scales = Nvfp4Scales(
        w13_block=torch.stack([torch.cat([gt["weight_scale"], up["weight_scale"]]) for gt, up, _ in parts]),
        w13_global=torch.stack([torch.cat([rows(gt), rows(up)]) for gt, up, _ in parts]),
        w2_block=torch.stack([d["weight_scale"] for _, _, d in parts]),
        w2_global=torch.stack([rows(d) for _, _, d in parts]))
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=g)
    return x, w13, torch.stack([d["weight"] for _, _, d in parts]), ids, weights, scales, parts


def per_expert_loop(x, ids, weights, parts):
    """Each (token, slot) through its expert's three linears as W4A16_NVFP4's reference linear computes them."""
    out = torch.zeros_like(x)
    for tok in range(x.shape[0]):
        for j, e in enumerate(ids[tok].tolist()):
            gate, up, down = parts[e]
            xt = x[tok:tok + 1]
            h = silu_and_mul_ref(torch.cat([W4A16_NVFP4.reference_linear(xt, gate),
                                            W4A16_NVFP4.reference_linear(xt, up)], -1))
            out[tok] += weights[tok, j] * W4A16_NVFP4.reference_linear(h, down)[0]
    return out


def close(out, ref, dtype):
    return (out.float() - ref.float()).abs().max() <= TOL[dtype] * ref.float().abs().max()


def test_nvfp4_reference_equals_format_linears():
    x, w13, w2, ids, weights, scales, parts = nvfp4_problem(7, 64, 32, 5, 2, seed=1)
    assert scales.w13_global[0, 0] != scales.w13_global[0, -1]  # gate's and up's global scales both in play
    ref = fused_moe_ref(x, w13, w2, ids, weights, nvfp4=scales)
    assert torch.allclose(ref, per_expert_loop(x, ids, weights, parts), atol=1e-5, rtol=0)


@interpreter_only
@pytest.mark.parametrize("path", ["moe_grouped", "moe_gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,hidden,inter", [(1, 128, 80), (9, 144, 48)])
def test_nvfp4_triton_matches_reference(path, dtype, t, hidden, inter):
    """hidden 128 / 144: two K steps, the second partial (144 = 64 + 64 + 16); N = 2 x 80 not a multiple of the
    column block; t 9 x top_k 2 pairs over 5 experts: some expert runs span padding."""
    x, w13, w2, ids, weights, scales, _ = nvfp4_problem(t, hidden, inter, 5, 2, dtype, seed=t)
    out = fused_moe_triton(x, w13, w2, ids, weights, nvfp4=scales, path=path)
    ref = fused_moe_ref(x, w13, w2, ids, weights, nvfp4=scales)
    assert out.dtype == dtype and close(out, ref, dtype)


@interpreter_only
@pytest.mark.parametrize("config", [(16, 32, 4, 2), (64, 64, 2, 3), (8, 16, 4, 1)])
def test_nvfp4_gemv_tiles_and_split_k_match_reference(config):
    """The per-pair GEMV under other tiles of Tuning.moe_gemv_config["nvfp4"]: K steps of 32 and 64 elements split
    over 2 and 3 programs (144 = 64 + 64 + 16: a partial last step), and a BLOCK_K below 32 raised to 32."""
    x, w13, w2, ids, weights, scales, _ = nvfp4_problem(3, 144, 48, 5, 2, torch.float32, seed=3)
    ref = fused_moe_ref(x, w13, w2, ids, weights, nvfp4=scales)
    table = {**tuning.current().moe_gemv_config, "nvfp4": config}
    with tuning.override(moe_gemv_config=tuning.frozen(table)):
        out = fused_moe_triton(x, w13, w2, ids, weights, nvfp4=scales, path="moe_gemv")
    assert close(out, ref, torch.float32)


@interpreter_only
@pytest.mark.parametrize("path", ["moe_grouped", "moe_gemv"])
def test_swapped_block_scales_fail(path):
    """The comparison catches a kernel that reads the neighbouring block's scale: swapping each pair of blocks."""
    x, w13, w2, ids, weights, scales, _ = nvfp4_problem(4, 128, 48, 4, 2, seed=4)
    bits = scales.w13_block.view(torch.uint8)  # torch has no flip for float8
    swapped = bits.view(4, 96, 4, 2).flip(3).reshape(4, 96, 8).view(torch.float8_e4m3fn)
    out = fused_moe_triton(x, w13, w2, ids, weights, nvfp4=scales._replace(w13_block=swapped), path=path)
    assert not close(out, fused_moe_ref(x, w13, w2, ids, weights, nvfp4=scales), torch.float32)


def test_mismatched_scales_are_refused():
    x, w13, w2, ids, weights, scales, _ = nvfp4_problem(2, 64, 32, 3, 1)
    with pytest.raises(ValueError, match="block scales"):
        grouped_gemm_nvfp4(x, w13, scales.w13_block[:, :, :2], scales.w13_global, ids.reshape(-1), ids[:0], 2, 1, 16)
