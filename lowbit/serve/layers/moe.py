"""Sparse mixture-of-experts block: a top-k softmax router (kept 16-bit) and the experts stacked per projection,
run over all tokens at once by lowbit.kernels.fused_moe (tokens sorted by expert, grouped GEMMs, weighted combine)."""
import torch
from torch import nn

from lowbit import kernels
from lowbit.serve.layers.linear import Linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, top_k], expert ids [T, top_k]): softmax in fp32 over all experts,
    the top_k largest, divided by their sum when renormalize (transformers' norm_topk_prob; Mixtral always)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoeExperts(nn.Module):
    """num_experts gated MLPs as two stacked weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
    w2 [E, H, I]. Built empty; the loader fills them from the checkpoint's per-expert linears named
    `{e}.{part}.weight` (part_names: gate, up, down) or from transformers' fused `gate_up_proj` / `down_proj`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.part_names = part_names
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def load(self, w13: torch.Tensor, w2: torch.Tensor, device, dtype) -> None:
        e, h, i = self.num_experts, self.hidden, self.intermediate
        if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
            raise ValueError(f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)}; expected {(e, 2 * i, h)}, "
                             f"{(e, h, i)}")
        self.w13 = w13.to(device, dtype).contiguous()
        self.w2 = w2.to(device, dtype).contiguous()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sum over each token's top_k experts of weight * expert(x) [T, H]."""
        return kernels.fused_moe(x, self.w13, self.w2, topk_ids, topk_weights)


class SparseMoe(nn.Module):
    """gate (router linear, HF name `gate`) -> route -> experts (HF name `experts`)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} is not in 1..num_experts ({num_experts})")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden, num_experts)
        self.experts = MoeExperts(num_experts, hidden, intermediate, part_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, ids, weights)
