"""Quantized linear layers for every lowbit format: prepare once at load, then call `linear` per step.

prepare_linear repacks a linear layer's on-disk modelopt tensors (weight, weight_scale, weight_scale_2, input_scale,
pre_quant_scale) into the layout its kernel wants. `linear` runs the kernel on CUDA and the torch reference
elsewhere; `linear_ref` is lowbit.formats.reference_linear's semantics: y = Q(x) @ W^T (+ bias), fp32 math.

On Hopper NVFP4 is served weight-only (no FP4 tensor cores): `linear` does NOT fake-quantize activations to NVFP4,
`linear_ref` does. The two differ by the activation quantization error (a few percent relative).

A static FP8 layer also takes x already quantized (float8_e4m3fn, x_true = x * input_scale), as written by
rms_norm / silu_and_mul given quant_scale=input_scale; the output is then bf16 (or out_dtype).
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lowbit import formats
from lowbit.formats import Format
from lowbit.kernels.linear import w4a16, w8a8
from lowbit.kernels._triton import on_gpu
from lowbit.kernels.linear.dense_gemv import dense_linear

W8A8_KERNELS = ("fp8", "int8")  # Format.kernel kinds that run act_quant + the fp8/int8 GEMM


@dataclass
class PreparedLinear:
    fmt: Format  # the layer's format (lowbit.formats); the unquantized one for a plain layer
    kind: str  # "dense" (dense_linear), "w8a8" (act_quant + fp8/int8 GEMM), "w4" (4-bit dequant GEMM), "source"
    in_features: int
    out_features: int
    weight: torch.Tensor | w4a16.W4Weight | None = None
    weight_scale: torch.Tensor | None = None  # w8a8: fp32 [] or [N]
    input_scale: torch.Tensor | None = None  # fp32 []; None means dynamic per-token (w8a8)
    smooth: torch.Tensor | None = None  # pre_quant_scale [K]
    source: dict | None = None  # the on-disk tensors, kept for the reference path on CPU
    _ref_weight: torch.Tensor | None = field(default=None, repr=False)

    @property
    def algo(self) -> str:
        """The format's quant_algo name (for display)."""
        return self.fmt.name

    def ref_weight(self) -> torch.Tensor:
        """The fp32 weight [N, K] this layer stands for (computed once, then cached)."""
        if self._ref_weight is None:
            self._ref_weight = self._dequantize()
        return self._ref_weight

    def _dequantize(self) -> torch.Tensor:
        if self.source is not None:
            return self.fmt.dequantize(self.source)
        if self.kind == "w4":
            return w4a16.dequantize_w4(self.weight)
        if self.kind == "w8a8":
            return self.weight.float() * self.weight_scale.float().reshape(-1, 1)
        return self.weight.float()

    def activation_tensors(self) -> dict:
        t = {"input_scale": self.input_scale, "pre_quant_scale": self.smooth}
        return {name: v for name, v in t.items() if v is not None}


def _f32(t, device):
    return None if t is None else t.to(device=device, dtype=torch.float32)


def prepare_linear(algo, tensors: dict, device, *, pack: bool | None = None, keep_source: bool | None = None):
    """Repack one linear layer's checkpoint tensors for `linear` on `device` (once, at load).

    pack: build the kernel layout (default: on CUDA). keep_source: keep the on-disk tensors too (default: when not
    packing; the CPU reference path uses them). in_features need not be a multiple of any kernel block.
    """
    fmt = formats.get(algo)
    device = torch.device(device)
    pack = device.type == "cuda" if pack is None else pack
    keep_source = (not pack) if keep_source is None else keep_source
    n, k = fmt.shape(tensors)
    p = PreparedLinear(fmt, "source", k, n, input_scale=_f32(tensors.get("input_scale"), device),
                       smooth=tensors["pre_quant_scale"].to(device) if "pre_quant_scale" in tensors else None)
    if fmt.dynamic_per_token:
        p.input_scale = None  # dynamic per token whatever the checkpoint holds
    if keep_source:
        p.source = {name: t.to(device) for name, t in tensors.items()}
        if not pack:  # the reference path's one fp32 weight, dequantized now rather than in the first request
            p.ref_weight()
    if pack:
        _pack(p, fmt, tensors, device)
    return p


def _pack(p: PreparedLinear, fmt: Format, t: dict, device):
    if fmt.kernel == "dense":
        p.kind, p.weight = "dense", t["weight"].to(device)
    elif fmt.kernel in W8A8_KERNELS:
        p.kind, p.weight = "w8a8", t["weight"].to(device).contiguous()
        p.weight_scale = _f32(t["weight_scale"], device).reshape(-1 if t["weight_scale"].numel() > 1 else ())
    elif fmt.kernel == "int4" and not w4a16.int4_group_supported(w4a16.int4_group(t["weight"], t["weight_scale"])):
        # rare group sizes: dequantize once and run a dense bf16 GEMM (x * pre_quant_scale is still applied)
        p.kind, p.weight = "dense", fmt.dequantize(t).to(device=device, dtype=torch.bfloat16)
    elif fmt.kernel == "int4":  # zero points (W4A16_ZP): the same kernels plus w4_zero_point's correction
        p.kind = "w4"
        zero = t.get("weight_zero_point")
        p.weight = w4a16.pack_int4(t["weight"].to(device), t["weight_scale"].to(device), p.smooth,
                                   None if zero is None else zero.to(device))
    else:  # "nvfp4"
        p.kind = "w4"
        p.weight = w4a16.pack_nvfp4(t["weight"].to(device), t["weight_scale"].to(device), t["weight_scale_2"], p.smooth)


def _out_dtype(x, out_dtype):
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if x.dtype == torch.float8_e4m3fn else x.dtype


def _check_fp8_input(p: PreparedLinear):
    if not p.fmt.static_fp8_input or p.input_scale is None:
        raise ValueError(f"a float8 input needs a static-scale FP8 layer, not {p.algo}")


def linear_ref(x: torch.Tensor, prepared: PreparedLinear, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """reference_linear semantics (NVFP4 activations fake-quantized): fp32 math, result in x's dtype."""
    if x.dtype == torch.float8_e4m3fn:  # dequantized and rounded to the output dtype, as fake quantization does
        _check_fp8_input(prepared)
        xq = (x.float() * prepared.input_scale.to(x.device)).to(_out_dtype(x, out_dtype)).float()
    else:
        xq = prepared.fmt.quantize_activation(x, prepared.activation_tensors()).float()
    y = F.linear(xq, prepared.ref_weight().to(x.device))  # the fp32 weight is dequantized once per layer
    if bias is not None:
        y = y + bias.float()
    return y.to(_out_dtype(x, out_dtype))


def linear(x: torch.Tensor, prepared: PreparedLinear, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] bf16/fp16 (or fp8, see above) -> [..., out] in x's dtype. Kernels on CUDA, else the reference."""
    if not on_gpu(x) or prepared.kind == "source":
        return linear_ref(x, prepared, bias, out_dtype)
    return run_kernels(x, prepared, bias, out_dtype)


def run_kernels(x: torch.Tensor, p: PreparedLinear, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel path of `linear`, whatever x's device (tests call it on CPU under TRITON_INTERPRET=1)."""
    x2 = x.reshape(-1, p.in_features)
    if x.dtype == torch.float8_e4m3fn:
        _check_fp8_input(p)
        y = w8a8.w8a8_linear_prequantized(x2, p.weight, p.weight_scale, p.input_scale, bias, _out_dtype(x, out_dtype))
    elif p.kind == "dense":
        xs = x2 * p.smooth.to(x.dtype) if p.smooth is not None else x2
        y = dense_linear(xs, p.weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None)
    elif p.kind == "w8a8":
        y = w8a8.w8a8_linear(x2, p.weight, p.weight_scale, p.input_scale, p.smooth, bias)
    else:
        y = w4a16.w4a16_gemm(x2, p.weight, bias)
    return y.reshape(*x.shape[:-1], p.out_features).to(_out_dtype(x, out_dtype))
