"""Checkpoint tensors for one linear layer in any modelopt format, quantized from a given float weight.

For tests and benchmarks (random weights at real shapes); the quantize pipeline uses modelopt, not this.
"""
import torch

from lowbit.formats import (E2M1_MAX, FP8_MAX, INT4_MAX, INT8_MAX, nvfp4_quantize, pack_e2m1,
                                       pack_int4_rows)


def _amax(t: torch.Tensor, dim=None) -> torch.Tensor:
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim)
    return a.float().clamp(min=1e-8)


def quantize_linear(algo: str, w: torch.Tensor, x_amax: float = 4.0, group: int = 128,
                    smooth: torch.Tensor | None = None, w_amax: float | None = None) -> dict:
    """w [N, K] float -> {weight, weight_scale, ...} as modelopt exports them for `algo`.

    smooth [K] (optional) is stored as pre_quant_scale where the format carries one (W8A8_SQ, W4A16_AWQ).
    w_amax (optional) fixes NVFP4's weight_scale_2 (modelopt gives q/k/v and gate/up one shared value).
    """
    w = w.float()
    t = {}
    if algo == "FP8":
        t["weight_scale"] = _amax(w) / FP8_MAX
        t["weight"] = (w / t["weight_scale"]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        t["input_scale"] = torch.tensor(x_amax / FP8_MAX)
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        t["weight_scale"] = _amax(w, 1) / FP8_MAX
        t["weight"] = (w / t["weight_scale"][:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    elif algo == "W8A8_SQ_PER_CHANNEL":
        t["weight_scale"] = _amax(w, 1) / INT8_MAX
        t["weight"] = (w / t["weight_scale"][:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        t["input_scale"] = torch.tensor(x_amax / INT8_MAX)
        t["pre_quant_scale"] = smooth if smooth is not None else torch.ones(w.shape[1], dtype=torch.bfloat16)
    elif algo == "W4A16_AWQ":
        n, k = w.shape
        groups = w.reshape(n, k // group, group)
        t["weight_scale"] = _amax(groups, 2) / INT4_MAX
        q = (groups / t["weight_scale"][:, :, None]).round().clamp(-8, 7).reshape(n, k).to(torch.int8)
        t["weight"] = pack_int4_rows(q)
        if smooth is not None:
            t["pre_quant_scale"] = smooth
    elif algo in ("NVFP4", "W4A16_NVFP4"):
        amax = _amax(w) if w_amax is None else torch.tensor(w_amax, device=w.device)
        t["weight_scale_2"] = amax / (E2M1_MAX * FP8_MAX)
        codes, t["weight_scale"] = nvfp4_quantize(w, t["weight_scale_2"])
        t["weight"] = pack_e2m1(codes)
        if algo == "NVFP4":
            t["input_scale"] = torch.tensor(x_amax / (E2M1_MAX * FP8_MAX))
    else:
        raise ValueError(f"unsupported quant_algo {algo!r}")
    return t


def random_w4_weight(fmt: str, n: int, k: int, group: int = 128, smooth=None, seed: int = 0):
    """A packed lowbit.kernels.linear.w4a16.W4Weight ("int4": W4A16_AWQ groups of `group`; "nvfp4") quantized from a
    random float weight [n, k] (std 0.02, seeded); smooth: the pre_quant_scale [k] or None."""
    from lowbit.kernels.linear import w4a16

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if fmt == "int4":
        t = quantize_linear("W4A16_AWQ", w, group=group, smooth=smooth)
        return w4a16.pack_int4(t["weight"], t["weight_scale"], smooth)
    t = quantize_linear("W4A16_NVFP4", w)
    return w4a16.pack_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], smooth)
