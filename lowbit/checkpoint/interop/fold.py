"""Folds pre_quant_scale vectors (SmoothQuant, AWQ) into the op before each linear, for formats with no such tensor.

x_in = x * s (s: the linear's pre_quant_scale [in]) is moved upstream where the same product can be formed exactly:
- q/k/v_proj, gate/up_proj: their RMSNorm's weight (w * s, or (1 + w) * s - 1 for Gemma's 1 + weight norms); every
  linear reading that norm must carry the same s.
- o_proj: v_proj's output rows (attention mixes positions, not channels); with grouped-query attention the query
  heads that share a KV head must have equal s, and an FP8 KV cache would quantize the scaled values differently.
- down_proj: up_proj's output rows (silu(gate) * up is linear in up).
A row scale is exact for formats whose weight scale is per output row (int4 groups, int8 / FP8 channels) or for a
float weight; per-tensor FP8 and NVFP4 rows cannot take it. Anything else is refused with one line naming why.
"""
import torch

from lowbit import formats
from lowbit.errors import UserError

PQS = "pre_quant_scale"
NORM_FED = {"self_attn": ("input_layernorm",), "mlp": ("pre_feedforward_layernorm", "post_attention_layernorm")}
NORM_READERS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
ROW_SOURCE = {"self_attn.o_proj": "self_attn.v_proj", "mlp.down_proj": "mlp.up_proj"}
ROW_SCALED = (formats.W4A16_AWQ, formats.W4A16_ZP, formats.W8A8_SQ_PER_CHANNEL, formats.FP8_PER_CHANNEL_PER_TOKEN,
              formats.INT8_PER_CHANNEL_PER_TOKEN)


def fold_pre_quant_scales(tensors: dict, layer_format, config: dict, kv_fp8: bool) -> dict:
    """tensors (lowbit names) -> the same model with every pre_quant_scale folded upstream (tensors is updated).

    layer_format(module) -> Format or None; config: config.json (model_type, attention heads)."""
    modules = sorted(k[: -len(PQS) - 1] for k in tensors if k.endswith("." + PQS))
    norm_groups = {}
    for module in modules:
        s = tensors.pop(f"{module}.{PQS}").float()
        if torch.all(s == 1):
            continue
        parent, _, leaf = module.rpartition(".")
        block, kind = parent.rpartition(".")[0], parent.rpartition(".")[2]
        if leaf in NORM_READERS.get(kind, ()):
            norm_groups.setdefault((block, kind), {})[leaf] = s
        elif f"{kind}.{leaf}" in ROW_SOURCE:
            source = f"{block}.{ROW_SOURCE[kind + '.' + leaf]}"
            if kind == "self_attn":
                if kv_fp8:
                    raise UserError(f"{module}: its pre_quant_scale would move into v_proj, whose outputs the FP8 KV "
                                    "cache quantizes per tensor; compressed-tensors has no per-input scale")
                s = _per_kv_head(module, s, config)
            _scale_rows(tensors, source, layer_format(source), s)
        else:
            raise UserError(f"{module}: no op before it can take its pre_quant_scale, and compressed-tensors has none")
    for (block, kind), scales in norm_groups.items():
        _fold_into_norm(tensors, block, kind, scales, config)
    return tensors


def _fold_into_norm(tensors: dict, block: str, kind: str, scales: dict, config: dict) -> None:
    readers = [r for r in NORM_READERS[kind] if f"{block}.{kind}.{r}.weight" in tensors]
    first = scales[readers[0]] if readers[0] in scales else None
    if first is None or any(r not in scales or not torch.equal(scales[r], first) for r in readers):
        raise UserError(f"{block}.{kind}: its linears {', '.join(readers)} do not share one pre_quant_scale, so "
                        "it cannot move into their norm")
    norm = next((f"{block}.{n}.weight" for n in NORM_FED[kind] if f"{block}.{n}.weight" in tensors), None)
    if norm is None:
        raise UserError(f"{block}.{kind}: no norm weight before it to take the pre_quant_scale")
    w = tensors[norm]
    if str(config.get("model_type", "")).startswith("gemma"):  # y = norm(x) * (1 + w)
        tensors[norm] = ((1 + w.float()) * first - 1).to(w.dtype)
    else:
        tensors[norm] = (w.float() * first).to(w.dtype)


def _per_kv_head(module: str, s: torch.Tensor, config: dict) -> torch.Tensor:
    """o_proj's s [heads * head_dim] -> the v_proj row scale [kv_heads * head_dim]; equal across each KV group."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    grouped = s.reshape(kv_heads, heads // kv_heads, -1)
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        raise UserError(f"{module}: its pre_quant_scale differs across the {heads // kv_heads} query heads sharing "
                        "a KV head, so v_proj cannot take it (grouped-query attention); quantize the float model "
                        "with --export-format compressed-tensors, which smooths o_proj per KV group")
    return grouped[:, 0].reshape(-1)


def _scale_rows(tensors: dict, module: str, fmt, c: torch.Tensor) -> None:
    """Multiplies the output rows of `module` by c [out] (weight, or its per-row scales, and bias)."""
    if fmt is not None and fmt not in ROW_SCALED:
        raise UserError(f"{module}: a {fmt.name} weight has no per-row scale to take the next linear's "
                        "pre_quant_scale exactly")
    key = f"{module}.weight" if fmt is None else f"{module}.weight_scale"
    if key not in tensors:
        raise UserError(f"{module}: tensor {key} is missing")
    t = tensors[key]
    if t.dim() == 1:
        tensors[key] = (t.float() * c).to(t.dtype)
    else:
        tensors[key] = (t.float() * c.reshape(-1, 1)).to(t.dtype)
    if f"{module}.bias" in tensors:
        b = tensors[f"{module}.bias"]
        tensors[f"{module}.bias"] = (b.float() * c).to(b.dtype)


__all__ = ["fold_pre_quant_scales"]
