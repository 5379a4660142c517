"""Layers of the served models. Each op comes from lowbit.kernels: Triton on the GPU, its torch reference elsewhere."""
import math

import torch
from torch import nn

from lowbit.kernels import dense_linear, linear as quant_linear
from lowbit.kernels import prepare_linear, rms_norm, rotary, silu_and_mul
from lowbit.serve.fuse import fp8_part_scales, merge_linear_tensors


class Linear(nn.Module):
    """y = x W^T + b for one checkpoint linear: plain weights, or any quant_algo through prepare_linear/linear.

    Built empty; `load(algo, tensors)` fills it from the checkpoint tensors of this module (keys are the on-disk
    suffixes: weight, weight_scale, weight_scale_2, input_scale, pre_quant_scale, bias).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.algo: str | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.prepared = None
        self.dtype: torch.dtype | None = None  # the model's activation dtype (also the output of an fp8 input)

    def load(self, algo: str | None, tensors: dict, device, dtype) -> None:
        tensors = dict(tensors)
        bias = tensors.pop("bias", None)
        if self.has_bias != (bias is not None):
            raise ValueError(f"bias expected={self.has_bias}, found={bias is not None}")
        self.bias = None if bias is None else bias.to(device, dtype)
        self.algo, self.dtype = algo, dtype
        if algo is None:
            self.weight = tensors["weight"].to(device, dtype)
        else:
            self.prepared = prepare_linear(algo, tensors, device)

    @property
    def fp8_input_scale(self) -> torch.Tensor | None:
        """The static FP8 input_scale when this layer takes its input already quantized (from a norm or silu)."""
        p = self.prepared
        return p.input_scale if p is not None and p.algo == "FP8" and p.input_scale is not None else None

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: this is a merged gate/up layer [..., 2D] and the result silu_and_mul of its output, [..., D]
        (one launch for an unquantized layer at one row on the GPU: the GEMV's epilogue)."""
        if self.algo is None:
            return dense_linear(x, self.weight, self.bias, silu_mul=silu_mul)
        y = quant_linear(x, self.prepared, self.bias, out_dtype=self.dtype)
        return silu_and_mul(y) if silu_mul else y


class MergedLinear(nn.Module):
    """Linears that share their input (q/k/v, gate/up), run as one GEMM; the output is their outputs side by side.

    `load(parts)` merges the checkpoint tensors (lowbit.serve.fuse); where they cannot be merged (mixed formats,
    unequal shared scales) each part keeps its own Linear and the outputs are concatenated.
    defer_part_scales: the caller multiplies part i's output by part_scales[i]. FP8 parts with unequal weight scales
    then merge with part 0's scale, so the GEMM runs per-tensor (faster than row-wise on the GPU); part_scales is
    fp32 [n_parts] on the layer's device, or None when the output is already exact.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, part_names: list[str],
                 defer_part_scales: bool = False):
        super().__init__()
        self.out_sizes, self.part_names = list(out_sizes), list(part_names)
        self.defer_part_scales = defer_part_scales
        self.merged = Linear(in_features, sum(out_sizes), bias)
        self.parts: list[Linear] | None = None
        self.part_scales: torch.Tensor | None = None

    def load(self, algos: list, tensors: list[dict], device, dtype, defer: bool | None = None) -> None:
        """defer: use part_scales; None: where it pays, on CUDA (on the CPU per-row scales cost nothing, and keep the
        reference path bit-identical to the per-part checkpoint reader)."""
        if defer is None:
            defer = self.defer_part_scales and torch.device(device).type == "cuda"
        if defer and not self.defer_part_scales:
            raise ValueError(f"{self.part_names}: this layer's caller does not apply part_scales")
        self.parts, self.part_scales = None, None
        if len(set(algos)) == 1:
            part_scales = fp8_part_scales(algos[0], tensors) if defer else None
            merged = merge_linear_tensors(algos[0], tensors, part_scales)
            if merged is not None:
                self.merged.load(algos[0], merged, device, dtype)
                self.part_scales = None if part_scales is None else part_scales.to(device, torch.float32)
                return
        self.parts = [Linear(self.merged.in_features, n, self.merged.has_bias) for n in self.out_sizes]
        for part, algo, t in zip(self.parts, algos, tensors):
            part.load(algo, t, device, dtype)

    @property
    def fp8_input_scale(self) -> torch.Tensor | None:
        return self.merged.fp8_input_scale if self.parts is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(out_sizes)]; with part_scales, part i's columns are its output / part_scales[i]."""
        if self.parts is None:
            return self.merged(x)
        return torch.cat([part(x) for part in self.parts], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None):
        """Returns normed(x + residual) and, when residual is given, the new residual x + residual.

        quant_scale: the next layer's static FP8 input_scale; the normed output is then float8_e4m3fn (out / scale).
        """
        out, res = rms_norm(x, self.weight, self.eps, residual, quant_scale)
        return out if residual is None else (out, res)


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor, quant_scale: torch.Tensor | None = None,
                up_scale: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up [T, 2 * inter] -> silu(gate) * up [T, inter] (float8_e4m3fn, out / quant_scale, if given).

        up_scale: fp32 0-d, multiplies up first (a merged gate/up layer's deferred part_scales[1]).
        """
        return silu_and_mul(gate_up, quant_scale, up_scale)


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for rope_type default, linear or llama3 (HF config conventions)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = int(head_dim * config.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos_sin_cache [max_positions, head_dim]: cos in the first half, sin in the second (float32)."""

    def __init__(self, config: dict, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotary(q, k, positions, self.cos_sin_cache)
