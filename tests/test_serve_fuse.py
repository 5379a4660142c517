"""Merged q/k/v and gate/up linears: one layer over the merged checkpoint tensors equals the parts side by side."""
import pytest
import torch

from lowbit.kernels import linear_ref, prepare_linear
from lowbit.kernels.synthetic import quantize_linear
from lowbit.serve.fuse import merge_linear_tensors
from lowbit.serve.layers import MergedLinear

SIZES = [96, 32, 32]  # q, k, v rows
K = 128
ALGOS = [None, "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NVFP4"]


def parts_for(algo, seed=0):
    g = torch.Generator().manual_seed(seed)
    smooth = (0.5 + torch.rand(K, generator=g)).to(torch.bfloat16)
    parts = []
    for i, n in enumerate(SIZES):
        w = (i + 1) * 0.02 * torch.randn(n, K, generator=g)  # unequal ranges: unequal per-tensor scales
        if algo is None:
            parts.append({"weight": w.to(torch.bfloat16)})
        else:
            kwargs = {"smooth": smooth} if algo in ("W8A8_SQ_PER_CHANNEL", "W4A16_AWQ") else {}
            parts.append(quantize_linear(algo, w, group=64, w_amax=0.2, **kwargs) if algo == "NVFP4" else
                         quantize_linear(algo, w, group=64, **kwargs))
    return parts


@pytest.mark.parametrize("algo", ALGOS)
def test_merged_layer_equals_parts_side_by_side(algo):
    parts = parts_for(algo)
    merged = merge_linear_tensors(algo, parts)
    assert merged is not None
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = torch.cat([linear_ref(x, prepare_linear(algo, p, "cpu")) for p in parts], dim=-1).float()
    got = linear_ref(x, prepare_linear(algo, merged, "cpu")).float()
    # fp32 math on the same dequantized weights; only the GEMM's blocking may differ, then rounding to bf16
    assert ((got - expected).norm() / expected.norm()).item() < 1e-3
    assert (got == expected).float().mean().item() > 0.99


def test_fp8_unequal_weight_scales_become_per_row_and_stay_exact():
    parts = parts_for("FP8")
    assert len({p["weight_scale"].item() for p in parts}) == 3
    merged = merge_linear_tensors("FP8", parts)
    assert merged["weight_scale"].shape == (sum(SIZES), 1)
    assert torch.equal(merged["weight"].view(torch.uint8), torch.cat([p["weight"] for p in parts]).view(torch.uint8))
    assert merged["weight_scale"][SIZES[0], 0] == parts[1]["weight_scale"]


@pytest.mark.parametrize("algo, name", [("FP8", "input_scale"), ("W4A16_AWQ", "pre_quant_scale"),
                                        ("NVFP4", "weight_scale_2")])
def test_unequal_shared_scales_are_not_merged(algo, name):
    parts = parts_for(algo)
    parts[1][name] = parts[1][name] * 2
    assert merge_linear_tensors(algo, parts) is None


def test_merged_linear_falls_back_to_parts():
    parts = parts_for("FP8")
    parts[2]["input_scale"] = parts[2]["input_scale"] * 2  # cannot share one quantized input
    layer = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"])
    layer.load(["FP8"] * 3, parts, "cpu", torch.bfloat16)
    assert layer.parts is not None and layer.fp8_input_scale is None
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = torch.cat([linear_ref(x, prepare_linear("FP8", p, "cpu")) for p in parts], dim=-1)
    assert torch.equal(layer(x), expected)
    mixed = MergedLinear(K, SIZES, False, ["q_proj", "k_proj", "v_proj"])
    mixed.load(["FP8", "FP8", None], parts[:2] + [parts_for(None)[2]], "cpu", torch.bfloat16)
    assert mixed.parts is not None and mixed(x).shape == (3, sum(SIZES))
