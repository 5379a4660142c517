"""Export's re-smoothing, run during calibration: linears that read one input get one pre_quant_scale before any
pass that must see the weights the checkpoint will hold (the AWQ clip search, GPTQ rounding)."""
from torch import nn


def share_pre_quant_scales(model: nn.Module) -> None:
    """Linears that share an input (q/k/v, gate/up) get one pre_quant_scale, as export would give them; export's
    re-smoothing rescales weights and recalibrates their amax, which would move them off the rounded grid. Only
    AWQ and SmoothQuant leave pre_quant_scales; a model without any is left alone."""
    if not any(getattr(getattr(m, "input_quantizer", None), "pre_quant_scale", None) is not None
               for m in model.modules()):
        return
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    if not getattr(model.config, "architectures", None):  # modelopt reads it (as export.py sets it)
        model.config.architectures = [type(model).__name__]
    requantize_resmooth_fused_llm_layers(model)
