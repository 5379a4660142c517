"""Joint clip choice for dev/bench/int4_levers.py: each weight group's clip ratio chosen by the error of the whole
output row over all calibration tokens, e^T H e (H = X^T X, GPTQ's Hessian), by coordinate descent over the groups
starting from the current amax; the AWQ clip search scores each group alone (cross-group terms dropped) on a
64-token subsample per call."""
import torch

from lowbit.calibrate.awq_clip import clip_ratios
from lowbit.calibrate.gptq import Hessians, quantized_linears


def _quantized(m, amax):
    wq = m.weight_quantizer
    wq.amax = amax
    return wq(m.weight).float()


@torch.no_grad()
def joint_clip(m, h: torch.Tensor, ratios: list[float], sweeps: int = 2) -> int:
    """Sets m's weight amax; returns how many groups changed ratio."""
    wq = m.weight_quantizer
    group = wq.block_sizes[-1]
    w = m.weight.float()
    out, inp = w.shape
    assert inp % group == 0
    amax0 = wq.amax.clone()  # [out * G, 1], the current (clip-searched) choice
    gmax = w.reshape(-1, group).abs().amax(1, keepdim=True)  # the groups' max: ratio 1
    cands = [gmax * r for r in ratios]
    errs = [_quantized(m, a) - w for a in cands]  # [out, in] per ratio
    amax = amax0.view(out, -1).clone()
    e = _quantized(m, amax0) - w
    v = e @ h  # [out, in]
    changed = torch.zeros_like(amax, dtype=torch.bool)
    for _ in range(sweeps):
        for g in range(inp // group):
            s = slice(g * group, (g + 1) * group)
            hgg, cur = h[s, s], e[:, s]
            best, best_e, best_a = torch.zeros(out), cur, amax[:, g].clone()
            for a, er in zip(cands, errs):
                d = er[:, s] - cur
                delta = ((d @ hgg) * d).sum(1) + 2 * (d * v[:, s]).sum(1)
                better = delta < best - 1e-12 * best.abs()
                best = torch.where(better, delta, best)
                best_e = torch.where(better[:, None], er[:, s], best_e)
                best_a = torch.where(better, a.view(out, -1)[:, g], best_a)
            v += (best_e - cur) @ h[s, :]
            e[:, s] = best_e
            changed[:, g] |= best_a != amax[:, g]
            amax[:, g] = best_a
    wq.amax = amax.reshape(amax0.shape).to(amax0.dtype)
    return int(changed.sum())


@torch.no_grad()
def joint_clip_search(model, forward_loop, min_clip_ratio=0.5, shrink_step=0.05, sweeps=2, skip=()) -> None:
    layers = [(n, m) for n, m in quantized_linears(model) if not n.endswith(tuple(skip))]
    hessians = Hessians(layers)
    try:
        forward_loop(model)
    finally:
        hessians.remove()
    ratios = clip_ratios(min_clip_ratio, shrink_step)
    total = groups = 0
    for name, m in layers:
        total += joint_clip(m, hessians.h.pop(name).double().float(), ratios, sweeps)
        groups += m.weight_quantizer.amax.numel()
    print(f"joint clip: {total} of {groups} groups changed ratio", flush=True)
