"""The MoE router's top-k kernel (lowbit.kernels.moe.route) under the Triton interpreter against torch's softmax /
topk / renormalize, and the layer's use of it."""
import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.moe.route import moe_route_ref, moe_route_triton  # noqa: E402

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter test")


def assert_same_route(weights, ids, logits, top_k, renormalize):
    """The reference's experts in its order, up to the order of tied probabilities (16-bit logits tie often): each
    slot's probability is the reference's top-k probability there; the weights match to fp32 rounding."""
    want_w, want_ids = moe_route_ref(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), -1)
    assert ids.dtype == want_ids.dtype and weights.dtype == torch.float32
    assert torch.equal(probs.gather(1, ids), probs.gather(1, want_ids))
    assert all(len(set(row)) == top_k for row in ids.tolist())  # k distinct experts per token
    assert torch.allclose(weights, want_w, atol=1e-6, rtol=1e-5)


@interpreter_only
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts,top_k,dtype", [(128, 8, torch.bfloat16), (8, 2, torch.float16), (6, 3, torch.float32),
                                                 (5, 5, torch.float32)])
def test_route_kernel_matches_torch(experts, top_k, dtype, renormalize):
    logits = (3 * torch.randn(9, experts, generator=torch.Generator().manual_seed(experts))).to(dtype)
    weights, ids = moe_route_triton(logits, top_k, renormalize)
    assert_same_route(weights, ids, logits, top_k, renormalize)
    if dtype == torch.float32:  # no ties: the very same ids
        assert torch.equal(ids, moe_route_ref(logits, top_k, renormalize)[1])


@interpreter_only
def test_route_kernel_ties_go_to_the_lower_expert():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    weights, ids = moe_route_triton(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3), atol=1e-7)


@interpreter_only
def test_route_kernel_on_no_tokens():
    weights, ids = moe_route_triton(torch.zeros(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def test_route_kernel_refuses_bad_top_k():
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        moe_route_triton(torch.zeros(2, 8), 9, False)
