"""The MoE router's top-k: router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]), softmax in fp32
over all experts, the k largest in descending order, divided by their sum when renormalize (transformers'
norm_topk_prob; Mixtral always). On the GPU one small kernel per step in place of torch's softmax / topk / sum / div
chain; ties go to the lower expert id there (torch.topk leaves their order open)."""
import torch

from lowbit.kernels._triton import kernel, next_pow2, on_gpu, tl, wait_for_producers


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not on_gpu(logits):
        return moe_route_ref(logits, top_k, renormalize)
    return moe_route_triton(logits, top_k, renormalize)


def moe_route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel (also under the CPU interpreter): one program per token."""
    t, e = logits.shape
    if not 0 < top_k <= e or logits.stride(-1) != 1:
        raise ValueError(f"moe_route: top_k {top_k} of {e} experts, logits need unit stride along experts")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k, RENORM=renormalize,
                            BLOCK_E=next_pow2(e), BLOCK_K=next_pow2(top_k))
    return weights, ids


@kernel
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    tok = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + tok * stride_t + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(experts < E, p, -1.0)  # below every probability: never picked
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked_id = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, experts, BLOCK_E), axis=0)  # the lowest id among ties
        picked_w = tl.where(slots == j, best, picked_w)
        picked_id = tl.where(slots == j, idx, picked_id)
        p = tl.where(experts == idx, -1.0, p)
    if RENORM:
        picked_w = picked_w / tl.sum(picked_w, axis=0)  # slots past TOP_K hold 0
    ok = slots < TOP_K
    tl.store(w_ptr + tok * TOP_K + slots, picked_w, mask=ok)
    tl.store(ids_ptr + tok * TOP_K + slots, picked_id.to(tl.int64), mask=ok)
