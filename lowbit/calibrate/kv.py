"""KV-cache scales: every attention layer must leave calibration with a calibrated k and v amax.

modelopt exports `k_proj.k_scale` / `v_proj.v_scale` = amax / 448 from the k/v bmm quantizers; a quantizer without
an amax would export nothing (engines then assume 1.0), so a missing one is an error, never a silent default.
"""
import torch


def kv_quantizers(model) -> dict:
    """{attention module name: (k_bmm_quantizer, v_bmm_quantizer)} for every quantized attention module."""
    return {name: (m.k_bmm_quantizer, m.v_bmm_quantizer)
            for name, m in model.named_modules() if hasattr(m, "k_bmm_quantizer")}


def check_kv_calibrated(model) -> None:
    quantizers = kv_quantizers(model)
    if not quantizers:
        raise RuntimeError("the recipe quantizes the KV cache but no attention module has k/v quantizers")
    for name, pair in quantizers.items():
        for kind, q in zip("kv", pair):
            amax = getattr(q, "amax", None)
            if not q.is_enabled or amax is None or not torch.isfinite(amax).all() or (amax <= 0).any():
                raise RuntimeError(f"{name}: {kind} cache quantizer is not calibrated (amax={amax})")
