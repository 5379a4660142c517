"""W4A16_ZP: W4A16_AWQ's int4 weight with a per-group zero point (asymmetric int4, as AutoAWQ, GPTQ asym and
compressed-tensors asymmetric pack-quantized store it); activations unquantized.

weight uint8 [out/2, in] as W4A16_AWQ (q in [-8, 7], row 2j in the low nibble), fp32 weight_scale [out, in/group],
int8 weight_zero_point [out, in/group] in [-8, 7]; w = (q - zero_point) * scale, in fp32 (exact: a 5-bit integer
times the scale). lowbit reads and serves it but does not make it. On the GPU it runs on the W4 kernels (kind
"int4": same packed codes and scales): the GEMV and w4_mma subtract the zero points from the codes themselves, the
others compute q * scale, minus (scale * zero_point) times x's group sums in fp32 (lowbit.kernels.linear.w4_zero_point).
"""
import torch

from lowbit.formats.base import GROUP_SHARD_DIMS, Format, Tensors, register
from lowbit.formats.numerics import pack_int4_rows, unpack_int4_rows

ZERO_POINT = "weight_zero_point"


class W4A16ZeroPoint(Format):
    name = "W4A16_ZP"
    tensors = Tensors(("weight", "weight_scale", ZERO_POINT))
    kernel = "int4"
    shard_dims = GROUP_SHARD_DIMS  # per-group scales split with the input features too

    def shape(self, t: dict) -> tuple[int, int]:
        rows, inp = t["weight"].shape
        return 2 * int(rows), int(inp)

    def dequantize(self, t: dict) -> torch.Tensor:
        q = unpack_int4_rows(t["weight"]).float()
        group = q.shape[1] // t["weight_scale"].shape[1]
        zero = t[ZERO_POINT].float().repeat_interleave(group, dim=1)
        return (q - zero) * t["weight_scale"].float().repeat_interleave(group, dim=1)

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        """min/max asymmetric round to nearest: scale = (max - min) / 15, zero_point = -8 - round(min / scale)."""
        w = w.float()
        n, k = w.shape
        groups = w.reshape(n, k // group, group)
        lo, hi = groups.amin(2).clamp(max=0), groups.amax(2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (-8 - (lo / scale).round()).clamp(-8, 7)
        q = (groups / scale[:, :, None] + zero[:, :, None]).round().clamp(-8, 7).reshape(n, k).to(torch.int8)
        return {"weight": pack_int4_rows(q), "weight_scale": scale, ZERO_POINT: zero.to(torch.int8)}

    def _merge_weight_scale(self, merged: dict, parts: list[dict]) -> None:
        super()._merge_weight_scale(merged, parts)
        merged[ZERO_POINT] = torch.cat([p[ZERO_POINT] for p in parts])


W4A16_ZP = register(W4A16ZeroPoint())
