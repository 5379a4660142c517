"""Rotary position embedding: inverse frequencies by rope_type and the cos/sin cache the kernels read."""
import math

import torch
from torch import nn

from lowbit.serve.layers import ops


ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ALIASES = {"su": "longrope"}  # the name older Phi-3 configs use


def rope_params(config: dict) -> tuple[str, dict]:
    """(rope_type, its parameters) from rope_parameters / rope_scaling; ValueError for what is not implemented."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # the kernels rotate every head dim (cos/sin width = head_dim)
        raise ValueError(f"partial_rotary_factor {partial} is not supported; supported: 1.0")
    return rope_type, params


def rope_inv_freq(config: dict, head_dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for rope_type default, linear, llama3 or longrope (HF config conventions;
    longrope: the short factors, or the long ones when `long`)."""
    rope_type, params = rope_params(config)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [head_dim/2]
    inv_freq = 1.0 / powers
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * powers)


def longrope_original_positions(config: dict) -> int:
    """The pretraining context of a longrope model: positions from here on use the long factors."""
    _, params = rope_params(config)
    return params.get("original_max_position_embeddings") or config["original_max_position_embeddings"]


def longrope_attention_factor(config: dict) -> float:
    """The factor cos and sin are multiplied by (transformers' _compute_longrope_parameters)."""
    _, params = rope_params(config)
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    original = longrope_original_positions(config)
    factor = params.get("factor") or config["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(config: dict, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(pos * inv_freq) in the first half, sin in the second.

    longrope: positions below the original context use the short factors, later ones the long factors, and cos/sin
    carry the attention factor. transformers switches by the length of each forward call instead (its decode steps
    agree: a token at position p >= original uses the long factors; a single prefill longer than the original
    context rotates its early positions with the long factors too, which a per-position cache cannot do).
    """
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    freqs = positions * rope_inv_freq(config, head_dim)[None, :]
    scale = 1.0
    if rope_params(config)[0] == "longrope":
        original = longrope_original_positions(config)
        freqs[original:] = positions[original:] * rope_inv_freq(config, head_dim, long=True)[None, :]
        scale = longrope_attention_factor(config)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale


class RotaryEmbedding(nn.Module):
    """cos_sin_cache [max_positions, head_dim]: cos in the first half, sin in the second (float32)."""

    def __init__(self, config: dict, head_dim: int, max_positions: int):
        super().__init__()
        self.register_buffer("cos_sin_cache", cos_sin_cache(config, head_dim, max_positions), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return ops.rotary(q, k, positions, self.cos_sin_cache)
