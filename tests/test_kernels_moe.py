"""Fused MoE (lowbit.kernels.moe): the expert alignment, the grouped GEMMs and the combine under the Triton interpreter
against the torch reference, and the reference against transformers' per-expert loop. bf16 runs only on the GPU
(the interpreter's bf16 dot is not numpy's: see dev/bench/moe_kernel.py); fp16 and fp32 here."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.align import moe_align, padded_size  # noqa: E402
from lowbit.kernels.moe.fused_moe import combine, combine_ref, fused_moe_ref, fused_moe_triton  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to the output's largest magnitude


def problem(t, hidden, inter, experts, top_k, dtype, seed=0, skip_expert=None):
    """Random x, stacked weights and routing; skip_expert: no token routed to it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    pool = [e for e in range(experts) if e != skip_expert]
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=g)
    return x, w13, w2, ids, weights


def test_align_lists_every_pair_once_grouped_by_expert():
    ids = torch.tensor([[3, 0], [0, 2], [3, 0]])
    sorted_ids, block_expert = moe_align(ids, num_experts=5, block_m=4)
    assert sorted_ids.numel() == padded_size(6, 5, 4) and block_expert.numel() == sorted_ids.numel() // 4
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < 6].long()
    assert sorted(real.tolist()) == list(range(6))
    for b, e in enumerate(block_expert.tolist()):  # every real pair sits in a block of its own expert
        rows = sorted_ids[b * 4:(b + 1) * 4]
        rows = rows[rows < 6].long()
        assert (e == -1 and rows.numel() == 0) or bool((flat[rows] == e).all())
    assert block_expert.tolist()[:3] == [0, 2, 3] and set(block_expert.tolist()[3:]) == {-1}


def test_reference_equals_transformers_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    x, w13, w2, ids, weights = problem(7, 32, 24, 6, 2, torch.float32)
    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6))
    hf.gate_up_proj.data, hf.down_proj.data = w13, w2
    with torch.no_grad():
        want = hf(x, ids, weights)
    assert torch.allclose(fused_moe_ref(x, w13, w2, ids, weights), want, atol=1e-5, rtol=0)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,top_k", [(1, 2), (5, 2), (19, 3)])
def test_fused_matches_reference(dtype, t, top_k):
    x, w13, w2, ids, weights = problem(t, 48, 40, 6, top_k, dtype, seed=t)
    out = fused_moe_triton(x, w13, w2, ids, weights)
    ref = fused_moe_ref(x, w13, w2, ids, weights)
    assert out.dtype == dtype and out.shape == x.shape
    assert (out.float() - ref.float()).abs().max() <= TOL[dtype] * ref.float().abs().max()


@interpreter_only
def test_fused_with_unrouted_expert_and_block_crossing_runs():
    """An expert no token reaches (its block count is 0) and an expert whose run spans more than one row block."""
    x, w13, w2, ids, weights = problem(40, 32, 16, 4, 2, torch.float32, seed=3, skip_expert=1)
    out = fused_moe_triton(x, w13, w2, ids, weights, block_m=16)
    assert (ids == 1).sum() == 0 and (ids == 0).sum() > 16
    assert torch.allclose(out, fused_moe_ref(x, w13, w2, ids, weights), atol=1e-5, rtol=0)


@interpreter_only
def test_combine_matches_reference():
    g = torch.Generator().manual_seed(5)
    rows, w = torch.randn(12, 70, generator=g).half(), torch.rand(4, 3, generator=g)
    assert torch.allclose(combine(rows, w).float(), combine_ref(rows, w).float(), atol=2e-3, rtol=0)
