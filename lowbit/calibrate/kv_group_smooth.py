"""o_proj smoothing made equal within each KV group (grouped-query attention), so it folds into v_proj's rows.

modelopt's AWQ and SmoothQuant give o_proj a per-input-channel pre_quant_scale s [heads * head_dim]; the query heads
that share one KV head read the same v_proj rows, so s can move into v_proj only where it is equal across them.
compressed-tensors has no pre_quant_scale, so before that export each o_proj gets s' = the geometric mean of s over
the query heads of its KV group (per head_dim position), and modelopt re-smooths it: the float weight W (= smoothed
weight * s) becomes W / s', the weight quantizer's amax is recalibrated by max and then given back each group's clip
ratio (amax / max |w| before, from AWQ's clip search: the clip searched for the old smoothing, carried over, not
searched again), and a static input amax becomes max_j(amax_j * s'_j) from the per-channel amax modelopt keeps.
"""
import torch

O_PROJ = "self_attn.o_proj"


def shared_scale(s: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """s [heads * head_dim] > 0 -> s' of the same shape, the geometric mean over each KV group's query heads."""
    grouped = s.float().reshape(kv_heads, heads // kv_heads, -1)
    mean = grouped.log().mean(dim=1, keepdim=True).exp()
    return mean.expand_as(grouped).reshape(-1)


def _pre_quant_scale(linear) -> torch.Tensor | None:
    q = getattr(linear, "input_quantizer", None)
    if q is None or not getattr(q, "_enable_pre_quant_scale", False):
        return None
    return getattr(q, "_pre_quant_scale", None)


def _clip_ratio(linear) -> torch.Tensor | None:
    """Each weight group's amax / its max |w| (an AWQ clip search's ratio; 1 after max calibration), or None for a
    quantizer without per-group amax."""
    wq = linear.weight_quantizer
    group = (wq.block_sizes or {}).get(-1)
    if group is None or wq.amax is None:
        return None
    top = linear.weight.detach().float().reshape(-1, group).abs().amax(-1).reshape(wq.amax.shape)
    return torch.where(top > 0, wq.amax.float() / top, torch.ones_like(top)).to(wq.amax.dtype)


@torch.no_grad()
def share_o_proj_smoothing(model) -> list[str]:
    """Re-smooths every calibrated o_proj whose pre_quant_scale differs within a KV group; returns their names."""
    from modelopt.torch.quantization.model_calib import (apply_pre_quant_scale_and_smooth,
                                                         disable_pre_quant_scale_and_resmooth)

    config = getattr(model.config, "text_config", model.config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    changed = []
    for name, module in model.named_modules():
        s = _pre_quant_scale(module) if name.endswith(O_PROJ) else None
        if s is None or kv_heads == heads:
            continue
        target = shared_scale(s, heads, kv_heads)
        if torch.equal(target.to(s.dtype), s.reshape(-1)):
            continue
        ratio = _clip_ratio(module)
        disable_pre_quant_scale_and_resmooth(module, delete_pre_quant_scale=True)
        apply_pre_quant_scale_and_smooth(module, target.to(module.weight.device))
        if ratio is not None:
            module.weight_quantizer.amax = module.weight_quantizer.amax * ratio
        changed.append(name)
    return changed


__all__ = ["share_o_proj_smoothing", "shared_scale"]
