"""FP8 weights snapped onto their fake-quant values before export, so the exported e4m3 codes are the ones
modelopt's fake quant (and the calibration-time model) computed.

modelopt's fake quant rounds w * (448/amax); its export rounds w / (amax/448). The two differ in the last ulp, and
a weight on an e4m3 rounding tie (a GGUF-derived model has many) lands one code apart, always on the same side for
the same tie: the exported model carries a bias the fake-quant model does not. A snapped weight q * amax/448 is on
the e4m3 grid, so both divisions give q exactly (the ulp error is far below half a grid step).
"""
import torch

E4M3 = (4, 3)  # modelopt's num_bits for float8 e4m3


def snappable(quantizer) -> bool:
    """An enabled e4m3 weight quantizer with per-tensor or per-channel amax (no blocks, no pre-quant scale)."""
    return (quantizer is not None and quantizer.is_enabled and tuple(quantizer.num_bits) == E4M3
            and not quantizer.block_sizes and getattr(quantizer, "_pre_quant_scale", None) is None
            and getattr(quantizer, "amax", None) is not None)


@torch.no_grad()
def snap_fp8_weights(model) -> int:
    """Every FP8 weight replaced by its fake-quant value, in place; returns the number of linears snapped."""
    count = 0
    for module in model.modules():
        wq = getattr(module, "weight_quantizer", None)
        if isinstance(module, torch.nn.Linear) and snappable(wq):
            module.weight.copy_(wq(module.weight).to(module.weight.dtype))
            count += 1
    return count
