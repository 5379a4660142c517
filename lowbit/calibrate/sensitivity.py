"""Per-unit sensitivity: KL of the model's next-token distribution when one unit of linears alone is quantized."""
from dataclasses import dataclass

import torch
from torch import nn

from lowbit import formats
from lowbit.calibrate.groups import layer_group
from lowbit.calibrate import nvfp4_clip

# linears that read the same input and merge into one kernel (q/k/v, gate/up) get one format together
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Choice:
    """One way to store a unit: a format (None: left 16-bit) at a group size."""
    label: str  # the recipe name it comes from, or "bf16"
    fmt: formats.Format | None
    group: int = 128
    weight_scale_search: str | None = None  # the recipe's NVFP4 block-scale search (calibrate/nvfp4_clip.py)


@dataclass
class InputStats:
    """Per linear, over the calibration batches: amax[name] max |input| (the static input scales' amax), squares[name]
    [in] the sum of each input column's square (the NVFP4 block-scale search's error weights)."""
    amax: dict[str, float]
    squares: dict[str, torch.Tensor]


def units(model: nn.Module, exclude=("lm_head",)) -> list[tuple[str, ...]]:
    """The model's linears (not excluded) grouped into units: fused siblings together, every other linear alone."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(n == e or n.endswith("." + e)
                                                                                         for e in exclude)]
    seen, out = set(), []
    for name in names:
        if name in seen:
            continue
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED if leaf in g), (leaf,))
        unit = tuple(f"{parent}.{s}" for s in group if f"{parent}.{s}" in names)
        seen.update(unit)
        out.append(unit)
    return out


@torch.no_grad()
def input_stats(model: nn.Module, batches: list[torch.Tensor], names) -> InputStats:
    """The float model's inputs to the linears `names` over the calibration batches."""
    found = InputStats({}, {})

    def hook(name):
        def record(_module, args):
            found.amax[name] = max(found.amax.get(name, 0.0), float(args[0].abs().max()))
            nvfp4_clip.add_column_squares(found.squares, name, args[0])
        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return found


def quantize_unit(model: nn.Module, unit, choice: Choice, stats: InputStats) -> dict[str, dict]:
    """{linear name: the choice's on-disk tensors} for every linear of a unit (shared input and weight amax; NVFP4
    block scales searched where the choice's recipe searches them, with that shared amax fixed)."""
    weights = {n: model.get_submodule(n).weight.detach().float() for n in unit}
    w_amax = max(float(w.abs().max()) for w in weights.values())
    x_amax = max(stats.amax[n] for n in unit)
    if choice.weight_scale_search:
        weights = {n: nvfp4_clip.search_clamp(w, torch.tensor(w_amax),
                                   stats.squares[n] if choice.weight_scale_search == "output" else None)
                   for n, w in weights.items()}
    return {n: choice.fmt.quantize(w, group=layer_group(w.shape[1], choice.group), x_amax=x_amax, w_amax=w_amax)
            for n, w in weights.items()}


def bits_per_weight(tensors: dict[str, dict], params: int) -> float:
    """Stored bits of a unit's quantized tensors (scales included) per weight."""
    return 8 * sum(t.numel() * t.element_size() for parts in tensors.values() for t in parts.values()) / params


class _Swapped(nn.Module):
    """A linear computed as its format's reference (dequantized weight, quantized activations)."""

    def __init__(self, fmt: formats.Format, tensors: dict, bias):
        super().__init__()
        self.fmt, self.act = fmt, {k: v for k, v in tensors.items() if k in ("input_scale", "pre_quant_scale")}
        self.weight, self.bias = fmt.dequantize(tensors), bias

    def forward(self, x):
        return nn.functional.linear(self.fmt.quantize_activation(x, self.act).float(), self.weight, self.bias).to(x.dtype)


@torch.no_grad()
def kl_with(model: nn.Module, batches, ref_logprobs: list, swaps: dict[str, dict], fmt) -> float:
    """Mean per-token KL(float || model with the linears in `swaps` quantized), in nats."""
    saved = {}
    for name, tensors in swaps.items():
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(parent)
        saved[name] = getattr(module, leaf)
        setattr(module, leaf, _Swapped(fmt, tensors, saved[name].bias))
    try:
        total = count = 0
        for ids, ref in zip(batches, ref_logprobs):
            lp = model(ids).logits.float().log_softmax(-1)
            total += float((ref.exp() * (ref - lp)).sum(-1).sum())
            count += ref.shape[0] * ref.shape[1]
        return total / count
    finally:
        for name, module in saved.items():
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, module)


@torch.no_grad()
def reference_logprobs(model: nn.Module, batches) -> list[torch.Tensor]:
    return [model(ids).logits.float().log_softmax(-1) for ids in batches]
