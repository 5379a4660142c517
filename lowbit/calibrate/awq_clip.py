"""AWQ clip search: each weight group's amax chosen from a grid of ratios of its max, by the error it causes in the
layer's output on calibration tokens.

The same search as modelopt 0.47's `awq_clip` (the second half of `awq_full`): the same ratio grid
(min_clip_ratio .. 1 in shrink_step, then 1), the same token subsample per forward call (every
(tokens // max_tokens)-th row of the inputs after pre_quant_scale), the same per-group loss (the mean over those
tokens of the squared error of that group's partial dot product, summed over calls) and the same tie rule (the
smallest ratio wins). lowbit's own code because of cost: modelopt forms the error as an elementwise
[out, tokens, in] product per ratio, and re-quantizes the whole weight for every block of output rows, about
8 s per decoder layer and batch of the embedded model on a CPU; here the error of a ratio is one batched matrix
product of the weight's quantization error with the tokens, group by group.

Loss of group g of row o: mean_t (x_t,g . (q(w)_o,g - w_o,g))^2, x_t,g the group's slice of token t.
"""
import torch
from torch import nn

CLIP_ARGS = ("min_clip_ratio", "shrink_step", "max_tokens_per_batch")


def clip_ratios(min_clip_ratio: float = 0.5, shrink_step: float = 0.05) -> list[float]:
    return [round(float(r), 2) for r in torch.arange(min_clip_ratio, 1.0, shrink_step)] + [1.0]


class _GroupClip:
    """One linear's search state: its max-calibrated amax [out * in/group, 1] and the summed loss per ratio."""

    def __init__(self, module: nn.Module, ratios: list[float]):
        from modelopt.torch.quantization.model_calib import enable_stats_collection, finish_stats_collection

        wq = module.weight_quantizer
        self.group = wq.block_sizes[-1]
        wq.reset_amax()
        enable_stats_collection(wq)
        wq(module.weight)
        finish_stats_collection(wq)
        self.amax = wq.amax.clone()
        out, inp = module.weight.shape
        groups = -(-inp // self.group)
        self.loss = {r: torch.zeros(out, groups, device=module.weight.device) for r in ratios}
        self.num_tokens = 0
        wq.disable()  # the calibration forward runs on float weights, as modelopt's does

    def add(self, module: nn.Module, x: torch.Tensor, max_tokens: int) -> None:
        """Adds one forward call's loss; x [..., in] is the linear's input after pre_quant_scale."""
        x = x.reshape(-1, x.shape[-1])
        x = x[0::max(1, x.shape[0] // max_tokens)].float()  # [tokens, in]
        self.num_tokens += x.shape[0]
        w = module.weight.float()
        pad = -w.shape[1] % self.group
        xg = nn.functional.pad(x, (0, pad)).reshape(x.shape[0], -1, self.group).permute(1, 2, 0)  # [groups, g, t]
        wq = module.weight_quantizer
        wq.enable()
        try:
            for ratio, loss in self.loss.items():
                wq.amax = self.amax * ratio
                err = nn.functional.pad(wq(module.weight).float() - w, (0, pad))
                err = err.reshape(err.shape[0], -1, self.group).transpose(0, 1)  # [groups, out, g]
                loss += torch.bmm(err, xg).pow(2).mean(dim=2).transpose(0, 1)  # [out, groups]
        finally:
            wq.amax = self.amax
            wq.disable()

    def best_amax(self) -> torch.Tensor:
        best_loss = torch.full_like(self.amax, float("inf"))
        best = torch.zeros_like(self.amax)
        for ratio, loss in self.loss.items():  # ascending ratios, 1 last: a tie keeps the smaller ratio
            loss = loss.view_as(self.amax)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best = torch.where(better, self.amax * ratio, best)
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
        lambda mod, args, name=name: searches[name].add(mod, mod.input_quantizer(args[0]), max_tokens_per_batch))
        for name, m in linears]
    try:
        forward_loop(model)
    finally:
        for h in hooks:
            h.remove()
    for name, m in linears:
        if searches[name].num_tokens > 0:
            m.weight_quantizer.amax = searches[name].best_amax()
        m.weight_quantizer.enable()
