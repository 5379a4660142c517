"""Joint clip refinement after the AWQ clip search: each output row's group clip ratios chosen together, by the
error of the whole row's output over every calibration token, e^T H e (H = X^T X of the linear's inputs in the
float model, collected during the clip search's pass; GPTQ's Hessian), by coordinate descent over the groups from the searched ratios. The clip search scores each group alone
(the cross-group terms of that error dropped) on a token subsample. Same grid, same format: only amax changes.

lowbit's own code (modelopt 0.47 has no such pass). Moving group g of row o from error e_g to e'_g (d = e'_g - e_g)
changes the row's error by d^T H_gg d + 2 d^T (H e)_g; H e is kept per row and updated after each group.
"""
import torch
from torch import nn

from lowbit.calibrate.awq_clip import clip_ratios
from lowbit.calibrate.gptq import Hessians, quantized_linears

SWEEPS = 2  # passes over the groups; a third changed almost nothing in the experiments (dev/bench/int4_levers.py)


def _error(module: nn.Module, amax: torch.Tensor) -> torch.Tensor:
    wq = module.weight_quantizer
    wq.amax = amax
    return wq(module.weight).float() - module.weight.float()


@torch.no_grad()
def refine_clips(module: nn.Module, h: torch.Tensor, ratios: list[float], sweeps: int = SWEEPS) -> int:
    """Sets the linear's weight amax [out * groups, 1] to the jointly refined clips; h [in, in]; returns how many
    groups changed ratio."""
    wq = module.weight_quantizer
    group = wq.block_sizes[-1]
    out, inp = module.weight.shape
    searched = wq.amax.clone()
    padded = nn.functional.pad(module.weight.detach().float(), (0, -inp % group))  # modelopt pads the last group
    group_max = padded.reshape(-1, group).abs().amax(1, keepdim=True).to(searched.dtype)
    cands = torch.stack([group_max * r for r in ratios]).view(len(ratios), out, -1)  # [R, out, groups]
    errs = torch.stack([_error(module, c.reshape(searched.shape)) for c in cands])  # [R, out, in]
    e = _error(module, searched)
    amax = searched.view(out, -1).clone()
    v = e @ h  # [out, in]
    for _ in range(sweeps):
        for g in range(amax.shape[1]):
            s = slice(g * group, min((g + 1) * group, inp))
            d = errs[:, :, s] - e[None, :, s]  # [R, out, g]
            delta = ((d @ h[s, s]) * d).sum(-1) + 2 * (d * v[None, :, s]).sum(-1)  # [R, out]
            best = delta.argmin(0)
            move = delta.gather(0, best[None])[0] < 0
            if not move.any():
                continue
            rows = move.nonzero()[:, 0]
            new = errs[best[rows], rows, s]  # [moved rows, g]
            v[rows] += (new - e[rows, s]) @ h[s, :]
            e[rows, s] = new
            amax[rows, g] = cands[best[rows], rows, g]
    wq.amax = amax.reshape(searched.shape)
    return int((amax.reshape(searched.shape) != searched).sum())


def input_hessians(model: nn.Module, skip: tuple[str, ...] | list[str] = ()) -> Hessians:
    """Hooks that collect H of every int4 group linear not named in `skip` during the next forward pass (the clip
    search's, on the float model's inputs); call .remove() after it."""
    return Hessians([(n, m) for n, m in quantized_linears(model) if not n.endswith(tuple(skip))], before_linear=True)


@torch.no_grad()
def joint_clip_refine(model: nn.Module, hessians: Hessians, min_clip_ratio: float = 0.5,
                      shrink_step: float = 0.05) -> tuple[int, int]:
    """Refines the clips of every linear `hessians` holds; returns (groups changed, groups refined)."""
    modules = dict(model.named_modules())
    ratios = clip_ratios(min_clip_ratio, shrink_step)
    changed = total = 0
    for name in list(hessians.h):
        m = modules[name]
        changed += refine_clips(m, hessians.h.pop(name), ratios)
        total += m.weight_quantizer.amax.numel()
    return changed, total
