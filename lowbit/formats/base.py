"""The Format object (one quant_algo: tensors, reference math, merge rule, calibration facts) and its registry."""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

TENSOR_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "weight_zero_point")
SHARED = ("input_scale", "pre_quant_scale", "weight_scale_2")  # must be equal in every merged part
ROW_WISE = ("weight", "bias")  # concatenated along the output rows when parts merge
# Tensor parallelism: on-disk suffix -> (dim split with a linear's output rows, dim split with its input features);
# None: the tensor is replicated on every rank. A one-element tensor is a per-tensor scale and always replicated.
# A split dim must divide by the ranks, so packed nibbles, per-group scales and zero points never straddle two ranks.
SHARD_DIMS = {"weight": (0, 1), "bias": (0, None), "weight_scale": (0, None), "weight_scale_2": (None, None),
              "input_scale": (None, None), "pre_quant_scale": (None, 0), "weight_zero_point": (0, 1)}
GROUP_SHARD_DIMS = dict(SHARD_DIMS, weight_scale=(0, 1))  # weight_scale [out, in / group]: split with either

# how a format quantizes a linear's input activations
ACT_NONE = "none"  # weight-only
ACT_STATIC = "static_per_tensor"  # one calibrated input_scale
ACT_PER_TOKEN = "dynamic_per_token"  # a scale per row from its own amax
ACT_BLOCK = "dynamic_block"  # NVFP4 blocks of 16, block scales from each block's amax

# kernel-level weight kinds that lowbit.kernels packs
KERNELS = ("dense", "fp8", "int8", "int4", "nvfp4")


class Tensors(NamedTuple):
    """On-disk per-linear tensor suffixes (bias aside): those every checkpoint has, those it may have."""
    required: tuple
    optional: tuple = ()


@dataclass(frozen=True)
class Calibration:
    """How `lowbit quantize` makes this format with modelopt."""
    stock: str  # name of modelopt's stock config (an attribute of modelopt.torch.quantization)
    algorithms: tuple  # calibration algorithms a recipe may ask for
    stock_by_algorithm: dict = field(default_factory=dict)  # algorithm -> another stock config
    block: int | None = None  # the one group size the format allows (a recipe may leave it unset)
    group_required: bool = False  # a recipe must set group_size; it becomes the weight quantizer's block size
    roundings: tuple = ("nearest",)  # weight roundings a recipe may ask for (gptq: int4 group scales only)
    # modelopt's per-layer format name (its export's layer_config_dict value): --layer-by-layer writes the
    # quantization config through modelopt's own builder; None: not made layer by layer
    modelopt_layer_format: str | None = None

    def stock_name(self, algorithm: str) -> str:
        return self.stock_by_algorithm.get(algorithm, self.stock)


class Format:
    """One quant_algo. Subclasses set the class attributes and implement dequantize / quantize."""
    name: str
    tensors: Tensors = Tensors(("weight",))
    weight_only: bool = True
    activation: str = ACT_NONE
    kernel: str = "dense"
    static_fp8_input: bool = False  # a producer (norm, silu) may hand this layer float8 input, x_true = x * input_scale
    dynamic_per_token: bool = False  # input_scale, if the checkpoint has one, is ignored
    calibration: Calibration | None = None  # None: lowbit reads and serves it but does not make it
    shard_dims: dict = SHARD_DIMS  # how tensor parallelism splits each on-disk tensor (SHARD_DIMS above)

    def __repr__(self) -> str:
        return f"Format({self.name})"

    def shape(self, t: dict) -> tuple[int, int]:
        """(out_features, in_features) of the linear that tensors `t` stand for."""
        out, inp = t["weight"].shape
        return int(out), int(inp)

    def dequantize(self, t: dict) -> torch.Tensor:
        """The float32 weight [out, in] that a checkpoint's tensors for one linear layer stand for."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, *, group: int = 128, smooth: torch.Tensor | None = None,
                 x_amax: float = 4.0, w_amax: float | None = None) -> dict:
        """w [out, in] float -> {weight, weight_scale, ...} as modelopt exports this format (round to nearest).

        group: int4 group size. smooth [in]: stored as pre_quant_scale where the format carries one. x_amax: the
        input amax behind a static input_scale. w_amax: fixes NVFP4's weight_scale_2 (q/k/v, gate/up share it).
        """
        raise NotImplementedError

    def _quantize_input(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        return x

    def quantize_activation(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        """x [..., in] as the format's kernels see it: pre_quant_scale applied, then the activation quantizer."""
        if "pre_quant_scale" in t:
            x = x * t["pre_quant_scale"].to(x.dtype)
        return self._quantize_input(x, t)

    def reference_linear(self, x: torch.Tensor, t: dict, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = Q(x) @ W^T (+ bias), computed in float32 and returned in x's dtype."""
        xq = self.quantize_activation(x, t).float()
        y = xq @ self.dequantize(t).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def part_scales(self, parts: list[dict]) -> torch.Tensor | None:
        """Weight-scale ratios a merge may defer to the output's consumer; None when there is nothing to defer."""
        return None

    def merge(self, parts: list[dict], part_scales: torch.Tensor | None = None) -> dict | None:
        """Tensors of linears that share an input (q/k/v, gate/up), by on-disk suffix in output order -> one
        layer's tensors (rows concatenated), or None when they cannot merge (different keys, unequal shared
        scales). part_scales: self.part_scales(parts), to defer the parts' scale ratios to the consumer."""
        keys = set(parts[0])
        if any(set(p) != keys for p in parts):
            return None
        for name in SHARED:
            if name in keys and not all(torch.equal(p[name], parts[0][name]) for p in parts):
                return None
        merged = {name: parts[0][name] for name in SHARED if name in keys}
        for name in ROW_WISE:
            if name in keys:
                merged[name] = torch.cat([p[name] for p in parts])
        if part_scales is not None:
            self._defer_part_scales(merged, parts, part_scales)
        else:
            self._merge_weight_scale(merged, parts)
        extra = keys - set(merged)
        if extra:
            raise ValueError(f"cannot merge linear tensors {sorted(extra)} of quant_algo {self.name}")
        return merged

    def _merge_weight_scale(self, merged: dict, parts: list[dict]) -> None:
        """Per-channel and per-group scales [out] / [out, groups] concatenate along the rows."""
        scale = torch.cat([p["weight_scale"].reshape(p["weight_scale"].shape[0], -1) for p in parts])
        merged["weight_scale"] = scale.reshape(-1) if parts[0]["weight_scale"].dim() == 1 else scale

    def _defer_part_scales(self, merged: dict, parts: list[dict], part_scales: torch.Tensor) -> None:
        raise ValueError(f"part_scales {tuple(part_scales.shape)} cannot defer {len(parts)} parts of {self.name}")


_REGISTRY: dict[str, Format] = {}
_ALIASES: dict = {}


def register(fmt: Format, aliases: tuple = ()) -> Format:
    """Add a format under its name (and aliases); returns it."""
    if fmt.kernel not in KERNELS:
        raise ValueError(f"{fmt.name}: kernel {fmt.kernel!r} is not one of {KERNELS}")
    _REGISTRY[fmt.name] = fmt
    for alias in aliases:
        _ALIASES[alias] = fmt
    return fmt


def get(name) -> Format:
    """The format of a quant_algo; None and the plain names (bf16, fp16, none) give the unquantized format."""
    fmt = _REGISTRY.get(name) if isinstance(name, str) else None
    fmt = fmt or _ALIASES.get(name)
    if fmt is None:
        raise ValueError(f"unsupported quant_algo {name!r}; known: {', '.join(names())} or None")
    return fmt


def names() -> list[str]:
    """Every registered quant_algo name, sorted."""
    return sorted(_REGISTRY)
