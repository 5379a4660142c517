"""GPTQ rounding of calibrated int4 group weights: each column rounded, its error spread over the later columns.

lowbit's own code, not modelopt 0.47's `gptq`, for two reasons: modelopt's pass starts with a fresh max
calibration, which throws away the scales (and clip ratios) an AWQ search set, so AWQ + GPTQ cannot be combined
there; and it fake-quantizes the whole weight matrix once per column (in_features full passes per layer), which is
minutes per layer on a CPU. This pass runs after any calibration, keeps the clip ratio each group's calibrated amax
has (AWQ clip search; 1 after max calibration), and rounds one column at a time.

Math (Frantar et al., GPTQ): H = 2 X^T X over the calibration inputs the weight sees (after pre_quant_scale),
damped by `damp` x mean(diag H); U = upper Cholesky factor of H^-1. Columns are rounded left to right; column j's
error (w_j - q_j) / U[j, j] is subtracted, times U[j, j+1:], from the columns not yet rounded.
"""
import torch
from torch import nn

from lowbit.formats.numerics import INT4_MAX

INT4_MIN = -INT4_MAX - 1


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear whose weight quantizer is on."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and getattr(m, "weight_quantizer", None) is not None
            and m.weight_quantizer.is_enabled]


def group_scales(module: nn.Module) -> tuple[torch.Tensor, int]:
    """(scale [out, in/group] = amax / 7, group) of an int4 group weight quantizer; ValueError for anything else."""
    wq = module.weight_quantizer
    group = (wq.block_sizes or {}).get(-1)
    if wq.num_bits != 4 or group is None or wq.amax is None:
        raise ValueError(f"GPTQ rounding needs a calibrated int4 group weight quantizer, got num_bits "
                         f"{wq.num_bits}, block_sizes {wq.block_sizes}")
    if getattr(wq, "pre_quant_scale", None) is not None:
        raise ValueError("GPTQ rounding needs pre_quant_scale folded into the weight")
    out, inp = module.weight.shape
    return wq.amax.float().reshape(out, inp // group) / INT4_MAX, group


def round_to_grid(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [out] rounded to the int4 grid of scale [out] (the dequantized value; 0 where the scale is 0)."""
    q = (w / scale).round().clamp(INT4_MIN, INT4_MAX) * scale
    return torch.where(scale > 0, q, torch.zeros_like(q))


def upper_inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """U, upper triangular with U^T U = (H + damp * mean(diag H) I)^-1; inputs that never fired get H_jj = 1."""
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def gptq_weight(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, group: int, damp: float = 0.01,
                block: int = 128, static_groups: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (GPTQ-rounded w [out, in], its scale [out, in/group]), given H [in, in] and the calibrated
    scale [out, in/group].

    static_groups: round against the calibrated scales as they are. Otherwise each group's scale is set when the
    pass reaches the group, from the weights as the earlier columns' errors left them, keeping the calibrated
    clip ratio (scale / (group amax / 7) of the original weight): GPTQ's reference behaviour, which keeps
    the propagated errors from being clipped at the group's edge."""
    if block % group:
        raise ValueError(f"GPTQ block {block} is not a multiple of the group size {group}")
    w, scale = w.float().clone(), scale.float().clone()
    group_max = w.reshape(w.shape[0], -1, group).abs().amax(-1)
    clip = torch.where(group_max > 0, scale * INT4_MAX / group_max, torch.ones_like(scale))
    u = upper_inverse_factor(h, damp)
    inp = w.shape[1]
    for b0 in range(0, inp, block):
        b1 = min(b0 + block, inp)
        wb, errs = w[:, b0:b1].clone(), torch.zeros_like(w[:, b0:b1])
        for i in range(b1 - b0):
            g = (b0 + i) // group
            if not static_groups and (b0 + i) % group == 0:
                scale[:, g] = clip[:, g] * wb[:, i:i + group].abs().amax(1) / INT4_MAX
            q = round_to_grid(wb[:, i], scale[:, g])
            errs[:, i] = (wb[:, i] - q) / u[b0 + i, b0 + i]
            wb[:, i:] -= errs[:, i, None] * u[b0 + i, b0 + i:b1][None, :]
            wb[:, i] = q
        w[:, b0:b1] = wb
        w[:, b1:] -= errs @ u[b0:b1, b1:]
    return w, scale


class Hessians:
    """H = 2/n sum x x^T of each hooked linear's input as its weight sees it (the input quantizer's output).
    before_linear: hook the linear itself and apply its input quantizer in the hook (for passes whose own hooks
    call the input quantizer too, e.g. the clip search's: the quantizer's hook would count each input twice)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], before_linear: bool = False):
        self.h = {name: torch.zeros(m.in_features, m.in_features) for name, m in layers}
        self.n = dict.fromkeys(self.h, 0)
        if before_linear:
            self.hooks = [m.register_forward_pre_hook(
                lambda mod, args, add=self._hook(name): add(None, None, mod.input_quantizer(args[0])))
                for name, m in layers]
        else:
            self.hooks = [m.input_quantizer.register_forward_hook(self._hook(name)) for name, m in layers]

    def _hook(self, name):
        def add(_module, _inputs, x):
            x = x.detach().reshape(-1, x.shape[-1]).float()
            n = self.n[name] + x.shape[0]
            self.h[name].mul_(self.n[name] / n).addmm_(x.t(), x, alpha=2.0 / n)
            self.n[name] = n
        return add

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


@torch.no_grad()
def gptq_round(model: nn.Module, forward_loop, damp: float = 0.01, block: int = 128,
               static_groups: bool = False, skip: tuple[str, ...] | list[str] = ()) -> None:
    """Replace every calibrated int4 group weight by its GPTQ rounding and its amax by the scales the rounding
    used, in place; linears whose name ends with one of `skip` keep their calibrated rounding to nearest.
    Hessians come from one pass of `forward_loop(model)` with the calibrated fake quantizers on."""
    from lowbit.calibrate.resmooth import share_pre_quant_scales
    from lowbit.progress import Progress

    share_pre_quant_scales(model)
    layers = [(n, m) for n, m in quantized_linears(model) if not n.endswith(tuple(skip))]
    scales = {name: group_scales(m) for name, m in layers}
    hessians = Hessians(layers)
    try:
        forward_loop(model)
    finally:
        hessians.remove()
    with Progress(len(layers), "GPTQ rounding", "linears") as bar:
        for name, m in layers:
            scale, group = scales[name]
            w, scale = gptq_weight(m.weight.data, hessians.h.pop(name), scale, group, damp, block, static_groups)
            m.weight.data.copy_(w.to(m.weight.dtype))
            m.weight_quantizer.amax = (scale * INT4_MAX).reshape(m.weight_quantizer.amax.shape)
            bar.update()
