"""Experiment (not shipped: no gain on the embedded model, docs/accuracy.md).

Per-channel smoothing folded exactly into the float weights (no pre_quant_scale): a linear's input channel j is
divided by s_j and its weight column j multiplied by s_j, the division done by the op that writes the input.

Where the division goes (Llama-family decoder layer; every fold is exact in float):
  qkv   input_layernorm.weight / s          q/k/v_proj columns * s
  gate  post_attention_layernorm.weight / s gate/up_proj columns * s
  o     v_proj rows / s                      o_proj columns * s (s shared by the query heads of one kv head: GQA)
  down  up_proj rows / s                     down_proj columns * s   (silu(gate) * up is linear in up)

s_j = a_j^alpha / w_j^(1 - alpha) (SmoothQuant's balance), a_j the channel's input statistic over the calibration
tokens, w_j the max |W[:, j]| over the linears that read it. NVFP4 quantizes inputs and weights in blocks of 16 input
channels, so s evens out the channels within a block for one side at the cost of the other; alpha sets the split.
"""
import torch
from torch import nn

from lowbit.errors import UserError

GROUPS = ("qkv", "gate", "o", "down")
STATS = ("max", "rms")  # a_j: max |x_j|, or sqrt(E[x_j^2])


def _layers(model: nn.Module) -> list[nn.Module]:
    if model.config.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise UserError(f"smoothing: model type {model.config.model_type!r} is not supported")
    return list(model.model.layers)


def _readers(layer, group: str) -> list[nn.Linear]:
    a, m = layer.self_attn, layer.mlp
    return {"qkv": [a.q_proj, a.k_proj, a.v_proj], "gate": [m.gate_proj, m.up_proj],
            "o": [a.o_proj], "down": [m.down_proj]}[group]


@torch.no_grad()
def input_stats(model: nn.Module, forward_loop, groups=GROUPS) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, group): {"max": [in], "sq": [in], "n": tokens}} of the float model's inputs to each group."""
    stats = {}

    def hook(key):
        def record(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            st = stats.setdefault(key, {"max": torch.zeros(x.shape[1]), "sq": torch.zeros(x.shape[1]), "n": 0})
            st["max"] = torch.maximum(st["max"], x.abs().amax(0))
            st["sq"] += x.pow(2).sum(0)
            st["n"] += x.shape[0]
        return record

    hooks = [_readers(layer, g)[0].register_forward_pre_hook(hook((i, g)))
             for i, layer in enumerate(_layers(model)) for g in groups]
    try:
        forward_loop(model)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _gqa(v: torch.Tensor, layer) -> torch.Tensor:
    """[heads * head_dim] -> [kv_heads, head_dim]: max over the query heads that read one kv head."""
    cfg = layer.self_attn.config
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    return v.reshape(kv, cfg.num_attention_heads // kv, d).amax(1)


def smoothing_scales(layer, group: str, st: dict, alpha: float, stat: str) -> torch.Tensor:
    """s [in] (for o: [kv_heads, head_dim]) from the input statistic and the readers' weight column maxima."""
    a = st["max"] if stat == "max" else (st["sq"] / st["n"]).sqrt()
    w = torch.stack([lin.weight.abs().float().amax(0) for lin in _readers(layer, group)]).amax(0)
    if group == "o":
        a, w = _gqa(a, layer), _gqa(w, layer)
    s = a.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)
    return s / s.log().mean().exp()  # geometric mean 1: a common factor changes nothing but the tensors' range


@torch.no_grad()
def fold(layer, group: str, s: torch.Tensor) -> None:
    """Divide group's input channels by s in the op that writes them, multiply the readers' columns by s."""
    a, m = layer.self_attn, layer.mlp
    if group == "qkv":
        writer, s_cols = layer.input_layernorm.weight, s
    elif group == "gate":
        writer, s_cols = layer.post_attention_layernorm.weight, s
    elif group == "down":
        writer, s_cols = m.up_proj.weight, s
    else:  # o: v rows per kv head; o columns per query head, each its kv head's s
        cfg = a.config
        writer = a.v_proj.weight
        s_cols = s.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, 0).reshape(-1)
        s = s.reshape(-1)
    shape = (-1, 1) if writer.dim() == 2 else (-1,)
    writer.copy_((writer.double() / s.double().reshape(shape)).to(writer.dtype))
    for lin in _readers(layer, group):
        lin.weight.copy_((lin.weight.double() * s_cols.double()[None, :]).to(lin.weight.dtype))


def smooth(model: nn.Module, forward_loop, alpha: float, groups=GROUPS, stat: str = "max") -> None:
    """Per-channel smoothing of every decoder layer's linear inputs, folded into the float weights."""
    stats = input_stats(model, forward_loop, groups)
    for i, layer in enumerate(_layers(model)):
        for g in groups:
            fold(layer, g, smoothing_scales(layer, g, stats[(i, g)], alpha, stat))


@torch.no_grad()
def permute(layer, group: str, st: dict) -> None:
    """Reorder the input channels of o_proj (within each head) or down_proj by their RMS, descending, so that each
    16-channel block holds channels of like magnitude; the writer's rows move with them (exact in float)."""
    rms = (st["sq"] / st["n"]).sqrt()
    a, m = layer.self_attn, layer.mlp
    if group == "down":
        order = rms.argsort(descending=True)
        for lin in (m.gate_proj, m.up_proj):
            lin.weight.copy_(lin.weight[order])
        m.down_proj.weight.copy_(m.down_proj.weight[:, order])
        return
    if group != "o":
        raise ValueError(f"permute: group {group!r} is not o or down")
    cfg = a.config
    kv, d, rep = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    within = _gqa(rms, layer).argsort(1, descending=True)  # [kv, d]
    v_order = (within + torch.arange(kv)[:, None] * d).reshape(-1)
    o_order = (within.repeat_interleave(rep, 0) + torch.arange(kv * rep)[:, None] * d).reshape(-1)
    a.v_proj.weight.copy_(a.v_proj.weight[v_order])
    a.o_proj.weight.copy_(a.o_proj.weight[:, o_order])


def reorder(model: nn.Module, forward_loop, groups=("o", "down")) -> None:
    stats = input_stats(model, forward_loop, groups)
    for i, layer in enumerate(_layers(model)):
        for g in groups:
            permute(layer, g, stats[(i, g)])
