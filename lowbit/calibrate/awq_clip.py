"""AWQ clip search: each weight group's amax chosen from a grid of ratios of its max, by the error it causes in the
layer's output on calibration tokens.

The same search as modelopt 0.47's `awq_clip` (the second half of `awq_full`): the same ratio grid
(min_clip_ratio .. 1 in shrink_step, then 1), the same token subsample per forward call (every
(tokens // max_tokens)-th row of the inputs after pre_quant_scale), the same per-group loss (the mean over those
tokens of the squared error of that group's partial dot product, summed over calls) and the same tie rule (the
smallest ratio wins). lowbit's own code because of cost: modelopt forms the error as an elementwise
[out, tokens, in] product per ratio, and re-quantizes the whole weight for every block of output rows, about
8 s per decoder layer and batch of the embedded model on a CPU; here each forward call only adds its tokens'
second moments per group, and each ratio is scored once at the end, so the search's cost hardly grows with the
calibration sequences (the forward passes dominate).

Loss of group g of row o: mean_t (x_t,g . e_o,g)^2 = e_o,g^T (mean_t x_t,g x_t,g^T) e_o,g, summed over calls,
e = q(w) - w, x_t,g the group's slice of token t.
"""
import torch
from torch import nn

CLIP_ARGS = ("min_clip_ratio", "shrink_step", "max_tokens_per_batch")


def clip_ratios(min_clip_ratio: float = 0.5, shrink_step: float = 0.05) -> list[float]:
    return [round(float(r), 2) for r in torch.arange(min_clip_ratio, 1.0, shrink_step)] + [1.0]


class _GroupClip:
    """One linear's search state: its max-calibrated amax [out * in/group, 1] and the second moments of each input
    group over the sampled tokens, H_g = sum over calls of mean_t x_t,g x_t,g^T [groups, g, g]: a group's loss
    at any ratio is e_o,g^T H_g e_o,g, so each token costs one rank-1 update and the ratios are scored once."""

    def __init__(self, module: nn.Module, ratios: list[float]):
        from modelopt.torch.quantization.model_calib import enable_stats_collection, finish_stats_collection

        wq = module.weight_quantizer
        self.group = wq.block_sizes[-1]
        self.ratios = ratios
        wq.reset_amax()
        enable_stats_collection(wq)
        wq(module.weight)
        finish_stats_collection(wq)
        self.amax = wq.amax.clone()
        groups = -(-module.weight.shape[1] // self.group)
        self.h = torch.zeros(groups, self.group, self.group, device=module.weight.device)
        self.num_tokens = 0
        wq.disable()  # the calibration forward runs on float weights, as modelopt's does

    def add(self, x: torch.Tensor, max_tokens: int) -> None:
        """Adds one forward call's tokens; x [..., in] is the linear's input after pre_quant_scale."""
        x = x.reshape(-1, x.shape[-1])
        x = x[0::max(1, x.shape[0] // max_tokens)].float()  # [tokens, in]
        self.num_tokens += x.shape[0]
        xg = nn.functional.pad(x, (0, -x.shape[1] % self.group)).reshape(x.shape[0], -1, self.group).transpose(0, 1)
        self.h += torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [groups, g, g]

    def best_amax(self, module: nn.Module) -> torch.Tensor:
        """The amax of the least-loss ratio per group (a tie keeps the smaller ratio)."""
        wq, w = module.weight_quantizer, module.weight.float()
        pad = -w.shape[1] % self.group
        best_loss = torch.full_like(self.amax, float("inf"))
        best = torch.zeros_like(self.amax)
        wq.enable()
        try:
            for ratio in self.ratios:  # ascending, 1 last
                wq.amax = self.amax * ratio
                err = nn.functional.pad(wq(module.weight).float() - w, (0, pad))
                err = err.reshape(err.shape[0], -1, self.group).transpose(0, 1)  # [groups, out, g]
                loss = (torch.bmm(err, self.h) * err).sum(-1).transpose(0, 1).reshape_as(self.amax)  # [out * groups, 1]
                better = loss < best_loss
                best_loss = torch.where(better, loss, best_loss)
                best = torch.where(better, self.amax * ratio, best)
        finally:
            wq.amax = self.amax
            wq.disable()
        return best


@torch.no_grad()
def awq_clip_search(model: nn.Module, forward_loop, min_clip_ratio: float = 0.5, shrink_step: float = 0.05,
                    max_tokens_per_batch: int = 64) -> None:
    """Sets the amax of every group-quantized linear's weight quantizer to its searched clip; one forward_loop
    call. The model's other quantizers are left as they are (callers run this only where weights are the only
    quantized tensors, so the forward sees exactly the float model)."""
    from modelopt.torch.quantization.utils import is_quantized_linear

    ratios = clip_ratios(min_clip_ratio, shrink_step)
    linears = [(name, m) for name, m in model.named_modules()  # the modules modelopt's awq_clip searches
               if is_quantized_linear(m) and m.weight_quantizer.is_enabled
               and m.weight_quantizer.block_sizes is not None]
    searches = {name: _GroupClip(m, ratios) for name, m in linears}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, name=name: searches[name].add(mod.input_quantizer(args[0]), max_tokens_per_batch))
        for name, m in linears]
    try:
        forward_loop(model)
    finally:
        for h in hooks:
            h.remove()
    for name, m in linears:
        if searches[name].num_tokens > 0:
            m.weight_quantizer.amax = searches[name].best_amax(m)
        m.weight_quantizer.enable()
