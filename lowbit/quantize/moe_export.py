"""Three repairs to modelopt 0.47's export of transformers' fused experts (`gate_up_proj` [E, 2I, H] / `down_proj`
[E, H, I] under `_QuantFusedExperts`) for block-quantized (INT4) weights, applied for the export call only.

0. Under AWQ an expert that no calibration token reached keeps uncalibrated weight quantizers (max calibration
   calibrates every expert's weights itself), and modelopt's fallback gives a block quantizer one per-tensor amax
   (the INT4 packing then fails). Such a quantizer (block or per channel) is calibrated here on its own expert's
   weight (max per group or channel): weight-only statistics, as every routed expert's weight scales are too.

1. Its AWQ pre-processing averages each projection's pre_quant_scale over `len(module.experts)` per-expert linears;
   fused experts have no such list (TypeError). Their input quantizer is one per projection, shared by every expert,
   so there is nothing to average: they are skipped.
2. Each expert's gate and up export from a copy of the fused weight quantizer whose amax is sliced to the half's rows
   ([rows, K / group]), but the copy keeps the fused weight's `_amax_shape_for_export` ([2I, -1]) and the reshape
   fails. The amax is already in the shape export wants, so that attribute is dropped from the experts' quantizers.
"""
from contextlib import contextmanager

from torch import nn


def _fused(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return experts is not None and hasattr(experts, "gate_up_proj") and not isinstance(experts, nn.ModuleList)


@contextmanager
def fused_experts_export(model: nn.Module):
    """Within this block modelopt's export handles the fused experts of `model` (see the module docstring)."""
    import modelopt.torch.export.unified_export_hf as unified

    for module in [m for m in model.modules() if _fused(m)]:
        _calibrate_unrouted(module.experts)
        for quantizer in module.experts.modules():
            if hasattr(quantizer, "_amax_shape_for_export"):
                del quantizer._amax_shape_for_export
    original = unified.get_experts_list

    def experts_list(module, model_type):
        return [] if _fused(module) else original(module, model_type)

    unified.get_experts_list = experts_list
    try:
        yield
    finally:
        unified.get_experts_list = original


def _calibrate_unrouted(experts: nn.Module) -> None:
    """Block or per-channel weight quantizers of experts without an amax -> max calibration on that expert's weight
    slice (modelopt's own fallback, one amax of the whole weight, is right only for per-tensor quantizers)."""
    for attr, weights in (("gate_up_proj_weight_quantizers", "gate_up_proj"), ("down_proj_weight_quantizers",
                                                                            "down_proj")):
        for idx, q in enumerate(getattr(experts, attr, [])):
            per_tensor = not q.block_sizes and q.axis is None
            if not q.is_enabled or per_tensor or getattr(q, "_amax", None) is not None:
                continue
            q.disable_quant()
            q.enable_calib()
            q(getattr(experts, weights)[idx].detach())
            q.load_calib_amax()
            q.enable_quant()
            q.disable_calib()
