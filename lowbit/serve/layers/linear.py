"""Linear layers over checkpoint tensors: one of any quant_algo, and linears sharing an input as one GEMM."""
import torch
from torch import nn

from lowbit import formats
from lowbit.kernels import prepare_linear
from lowbit.serve.layers import ops


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
        # tensor parallelism: how the ranks' outputs become the layer's (all-reduce, vocabulary gather); None: as is
        self.combine = None

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
        return p.input_scale if p is not None and p.fmt.static_fp8_input and p.input_scale is not None else None

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: this is a merged gate/up layer [..., 2D] and the result silu_and_mul of its output, [..., D]
        (one launch for an unquantized layer at one row on the GPU: the GEMV's epilogue)."""
        if self.algo is None:
            y = ops.dense_linear(x, self.weight, self.bias, silu_mul=silu_mul)
        else:
            y = ops.quant_linear(x, self.prepared, self.bias, out_dtype=self.dtype)
            y = ops.silu_and_mul(y) if silu_mul else y
        return y if self.combine is None else self.combine(y)


class MergedLinear(nn.Module):
    """Linears that share their input (q/k/v, gate/up), run as one GEMM; the output is their outputs side by side.

    `load(parts)` merges the checkpoint tensors by their format's merge rule (Format.merge: one GEMM over the
    concatenated output rows); where they cannot be merged (mixed formats, unequal shared scales) each part keeps its
    own Linear and the outputs are concatenated.
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
            fmt = formats.get(algos[0])
            part_scales = fmt.part_scales(tensors) if defer else None
            merged = fmt.merge(tensors, part_scales)
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
