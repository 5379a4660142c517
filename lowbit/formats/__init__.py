"""The format registry: one Format per quant_algo (lowbit/formats/<format>.py), per-layer resolution, KV formats.

Adding a format = one module here that registers a Format, plus its kernels. The shared numerics and the
algo-keyed reference functions (dequantize_weight, quantize_activation, reference_linear) are exported here too.
"""
import torch

from lowbit.formats.base import (ACT_BLOCK, ACT_NONE, ACT_PER_TOKEN, ACT_STATIC, KERNELS, TENSOR_SUFFIXES, Calibration,
                                 Format, Tensors, get, names)
from lowbit.formats.bf16 import BF16
from lowbit.formats.fp8 import FP8
from lowbit.formats.fp8_per_token import FP8_PER_CHANNEL_PER_TOKEN
from lowbit.formats.int8_per_token import INT8_PER_CHANNEL_PER_TOKEN
from lowbit.formats.kv import KV_FP8, KVFormat, kv_format, kv_names
from lowbit.formats.layers import MIXED_PRECISION, layer_algo, layer_format
from lowbit.formats.numerics import (E2M1_MAX, E2M1_VALUES, FP8_MAX, INT4_MAX, INT8_MAX, NVFP4_BLOCK, e2m1_codes,
                                     e2m1_decode, fake_quant_fp8, fake_quant_fp8_per_token, fake_quant_int8,
                                     fake_quant_int8_per_token,
                                     fake_quant_nvfp4, nvfp4_block_scale, nvfp4_dequantize, nvfp4_quantize, pack_e2m1,
                                     pack_int4_rows, unpack_e2m1, unpack_int4_rows)
from lowbit.formats.nvfp4 import NVFP4
from lowbit.formats.w4a16_awq import W4A16_AWQ
from lowbit.formats.w4a16_nvfp4 import W4A16_NVFP4
from lowbit.formats.w4a16_zp import W4A16_ZP
from lowbit.formats.w8a8_sq import W8A8_SQ_PER_CHANNEL


def calibrated() -> list[Format]:
    """The formats `lowbit quantize` makes (those with calibration facts), by name."""
    return [get(n) for n in names() if get(n).calibration is not None]


def dequantize_weight(algo, t: dict) -> torch.Tensor:
    """The float32 weight [out, in] that a checkpoint's tensors for one linear layer stand for."""
    return get(algo).dequantize(t)


def quantize_activation(algo, x: torch.Tensor, t: dict) -> torch.Tensor:
    """x [..., in] as the format's kernels see it: pre_quant_scale applied, then the activation quantizer."""
    return get(algo).quantize_activation(x, t)


def reference_linear(algo, x: torch.Tensor, t: dict, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = Q(x) @ W^T (+ bias), computed in float32 and returned in x's dtype."""
    return get(algo).reference_linear(x, t, bias)


__all__ = [
    "ACT_BLOCK", "ACT_NONE", "ACT_PER_TOKEN", "ACT_STATIC", "KERNELS", "TENSOR_SUFFIXES", "Calibration", "Format",
    "Tensors", "get", "names", "calibrated", "layer_algo", "layer_format", "MIXED_PRECISION", "KVFormat", "KV_FP8",
    "kv_format", "kv_names", "BF16", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_AWQ", "W4A16_NVFP4",
    "W8A8_SQ_PER_CHANNEL", "W4A16_ZP", "INT8_PER_CHANNEL_PER_TOKEN",
    "E2M1_MAX", "E2M1_VALUES", "FP8_MAX", "INT4_MAX", "INT8_MAX", "NVFP4_BLOCK", "e2m1_codes",
    "e2m1_decode", "fake_quant_fp8", "fake_quant_fp8_per_token", "fake_quant_int8", "fake_quant_nvfp4",
    "fake_quant_int8_per_token",
    "nvfp4_block_scale", "nvfp4_dequantize", "nvfp4_quantize", "pack_e2m1", "pack_int4_rows", "unpack_e2m1",
    "unpack_int4_rows", "dequantize_weight", "quantize_activation", "reference_linear",
]
