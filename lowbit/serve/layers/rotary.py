"""Rotary position embedding: inverse frequencies by rope_type and the cos/sin cache the kernels read."""
import math

import torch
from torch import nn

from lowbit.serve.layers import ops


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
        return ops.rotary(q, k, positions, self.cos_sin_cache)
