"""Smoothing fold: each decoder layer's linear inputs divided per channel by s, folded exactly into the float weights.

A channel j of a linear's input is divided by s_j in the op that writes it and the readers' weight columns j are
multiplied by s_j, so the float function is unchanged and the checkpoint keeps its tensors, names and shapes (no
pre_quant_scale, nothing online). Where each division goes:

  qkv   the input norm's weight (Gemma: 1 + weight)          q/k/v_proj (or qkv_proj) columns
  mlp   the norm before the MLP                               gate/up_proj (or gate_up_proj) columns; in a
                                                              mixture-of-experts block the router's and every
                                                              expert's gate/up columns (one s for the block's input)
  o     v_proj rows and bias (or qkv_proj's v rows)           o_proj columns, s shared by the query heads of a kv head
  down  up_proj rows and bias (or gate_up_proj's up half)     down_proj columns (act(gate) * up is linear in up); not
                                                              in an expert block, whose down input quantizer is one
                                                              for all experts

s_j = a_j^alpha / w_j^(1 - alpha) (SmoothQuant's balance) with a_j the channel's input statistic over the calibration
tokens (max |x_j| or sqrt(E[x_j^2])) and w_j the largest |W[:, j]| among the readers, scaled to geometric mean 1.
Block formats quantize inputs and weights along the same channels, so s moves rounding error from one side to the
other; alpha sets the split.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lowbit.errors import UserError

STATS = ("max", "rms")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")  # RMSNorm scales by 1 + weight
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe") + GEMMA_TYPES


@dataclass
class Fold:
    """One group of channels: the readers' shared input, written by `writer` (a norm, or rows of a linear)."""
    name: str  # qkv | mlp | o | down
    readers: list[torch.Tensor]  # weights whose last dimension is the input channel: [out, in] or experts' [E, out, in]
    hook: nn.Module  # the module whose forward input is the group's input
    writer: nn.Module
    rows: slice | None = None  # the writer linear's rows that produce the channels; None: a norm
    one_plus: bool = False  # the norm scales by 1 + weight (Gemma)
    kv_heads: int = 0  # o: s per kv channel [kv_heads * head_dim], each shared by `rep` query heads
    rep: int = 1


def folds(layer: nn.Module, config) -> list[Fold]:
    """The layer's fold groups (see the module docstring); raises UserError for a family without a plan."""
    if config.model_type not in FAMILIES:
        raise UserError(f"smoothing: model type {config.model_type!r} is not supported (only {', '.join(FAMILIES)});"
                        " use a copy of the recipe with 'smoothing: null'")
    gemma = config.model_type in GEMMA_TYPES
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = attn.head_dim
    if hasattr(attn, "qkv_proj"):
        qkv, q_rows = [attn.qkv_proj], heads * d
        v_writer, v_rows = attn.qkv_proj, slice(q_rows + kv * d, q_rows + 2 * kv * d)
    else:
        qkv, v_writer, v_rows = [attn.q_proj, attn.k_proj, attn.v_proj], attn.v_proj, slice(None)
    out = [Fold("qkv", [m.weight for m in qkv], qkv[0], layer.input_layernorm, one_plus=gemma),
           Fold("o", [attn.o_proj.weight], attn.o_proj, v_writer, v_rows, kv_heads=kv, rep=heads // kv)]
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    experts, router = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter):
        out.append(Fold("mlp", [router.weight, experts.gate_up_proj], mlp, mlp_norm, one_plus=gemma))
    elif hasattr(mlp, "gate_up_proj") and isinstance(mlp.gate_up_proj, nn.Linear):
        inter = mlp.down_proj.in_features
        out += [Fold("mlp", [mlp.gate_up_proj.weight], mlp.gate_up_proj, mlp_norm, one_plus=gemma),
                Fold("down", [mlp.down_proj.weight], mlp.down_proj, mlp.gate_up_proj, slice(inter, 2 * inter))]
    elif all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        out += [Fold("mlp", [mlp.gate_proj.weight, mlp.up_proj.weight], mlp.gate_proj, mlp_norm, one_plus=gemma),
                Fold("down", [mlp.down_proj.weight], mlp.down_proj, mlp.up_proj, slice(None))]
    else:
        raise UserError(f"smoothing: {type(mlp).__name__} is neither a gated MLP nor fused experts")
    return out


class InputStats:
    """Per fold group of each layer, over the tokens seen: max |x_j| and sum x_j^2 [in], and the token count."""

    def __init__(self):
        self.max: dict[tuple[int, str], torch.Tensor] = {}
        self.sq: dict[tuple[int, str], torch.Tensor] = {}
        self.n: dict[tuple[int, str], int] = {}

    def add(self, key, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        m, sq = x.abs().amax(0), x.pow(2).sum(0)
        self.max[key] = torch.maximum(self.max[key], m) if key in self.max else m
        self.sq[key] = self.sq[key] + sq if key in self.sq else sq
        self.n[key] = self.n.get(key, 0) + x.shape[0]

    def statistic(self, key, stat: str) -> torch.Tensor:
        return self.max[key] if stat == "max" else (self.sq[key] / self.n[key]).sqrt()


@contextmanager
def recording(layers: list[nn.Module], config):
    """Yields InputStats keyed (index in `layers`, group) that fill while the layers run in float."""
    stats = InputStats()
    handles = []
    for i, layer in enumerate(layers):
        for f in folds(layer, config):
            hook = (lambda key: lambda _, args: stats.add(key, args[0]))((i, f.name))
            handles.append(f.hook.register_forward_pre_hook(hook))
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def _per_kv(v: torch.Tensor, f: Fold) -> torch.Tensor:
    """o's [heads * head_dim] -> [kv_heads * head_dim]: the max over the query heads that read one kv head."""
    return v.reshape(f.kv_heads, f.rep, -1).amax(1).reshape(-1) if f.kv_heads else v


def scales(f: Fold, a: torch.Tensor, alpha: float) -> torch.Tensor:
    """s (in the writer's channel space) from the input statistic a [in] and the readers' column maxima."""
    w = torch.stack([r.detach().abs().float().reshape(-1, r.shape[-1]).amax(0) for r in f.readers]).amax(0)
    a, w = _per_kv(a, f), _per_kv(w, f)
    s = a.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)
    return s / s.log().mean().exp()  # geometric mean 1: a common factor changes nothing but the tensors' range


@torch.no_grad()
def fold(f: Fold, s: torch.Tensor) -> None:
    """Divide the group's channels by s where they are written, multiply the readers' columns by s (in float64)."""
    s = s.double()
    if f.rows is None:
        w = f.writer.weight
        new = (1 + w.double()) / s - 1 if f.one_plus else w.double() / s
        w.copy_(new.to(w.dtype))
    else:
        w = f.writer.weight[f.rows]
        f.writer.weight[f.rows] = (w.double() / s[:, None]).to(w.dtype)
        if f.writer.bias is not None:
            b = f.writer.bias[f.rows]
            f.writer.bias[f.rows] = (b.double() / s).to(b.dtype)
    cols = s.reshape(f.kv_heads, 1, -1).expand(-1, f.rep, -1).reshape(-1) if f.kv_heads else s
    for r in f.readers:
        r.copy_((r.double() * cols).to(r.dtype))


def smooth_layers(layers: list[nn.Module], config, stats: InputStats, alpha: float, stat: str) -> None:
    for i, layer in enumerate(layers):
        # row folds first: they rescale rows of v_proj / up_proj, whose columns the norm folds then balance
        for f in sorted(folds(layer, config), key=lambda f: f.rows is None):
            fold(f, scales(f, stats.statistic((i, f.name), stat), alpha))


def smooth(model: nn.Module, forward_loop, alpha: float, stat: str) -> None:
    """Records every decoder layer's inputs over `forward_loop(model)` (float), then folds the smoothing in."""
    if stat not in STATS:
        raise ValueError(f"smoothing statistic {stat!r} is not one of {STATS}")
    layers = list(getattr(model, model.base_model_prefix).layers)
    with recording(layers, model.config) as stats:
        forward_loop(model)
    smooth_layers(layers, model.config, stats, alpha, stat)
