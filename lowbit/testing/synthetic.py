"""Checkpoint tensors for one linear layer in any modelopt format, quantized from a given float weight.

For tests and benchmarks (random weights at real shapes); the quantize pipeline uses modelopt, not this.
"""
import torch

from lowbit import formats


def quantize_linear(algo: str, w: torch.Tensor, x_amax: float = 4.0, group: int = 128,
                    smooth: torch.Tensor | None = None, w_amax: float | None = None) -> dict:
    """w [N, K] float -> {weight, weight_scale, ...} as modelopt exports them for `algo` (Format.quantize).

    smooth [K] (optional) is stored as pre_quant_scale where the format carries one.
    w_amax (optional) fixes an NVFP4 weight_scale_2 (modelopt gives q/k/v and gate/up one shared value).
    """
    return formats.get(algo).quantize(w, group=group, smooth=smooth, x_amax=x_amax, w_amax=w_amax)


def random_w4_weight(fmt: str, n: int, k: int, group: int = 128, smooth=None, seed: int = 0):
    """A packed lowbit.kernels.linear.w4a16.W4Weight ("int4": int4 AWQ groups of `group`; "nvfp4") quantized from a
    random float weight [n, k] (std 0.02, seeded); smooth: the pre_quant_scale [k] or None."""
    from lowbit.kernels.linear import w4a16

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if fmt == "int4":
        t = formats.W4A16_AWQ.quantize(w, group=group, smooth=smooth)
        return w4a16.pack_int4(t["weight"], t["weight_scale"], smooth)
    t = formats.W4A16_NVFP4.quantize(w)
    return w4a16.pack_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], smooth)
