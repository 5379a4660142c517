"""W4A16_AWQ: int4 weight packed two output rows per byte (uint8 [out/2, in], row 2j in the low nibble, no zero
point), fp32 weight_scale [out, in/group] = amax/7; activations unquantized.

pre_quant_scale [in] is on disk only where the input is not shared (o_proj, down_proj); for q/k/v and gate/up
modelopt folds it into the RMSNorm weight. Export refuses in % group != 0: lowbit gives such layers a smaller group
and the checkpoint becomes MIXED_PRECISION with a per-layer group_size (lowbit.calibrate.groups). INT4 RTN exports
the same layout without pre_quant_scale.
"""
import torch

from lowbit.formats.base import GROUP_SHARD_DIMS, Calibration, Format, Tensors, register
from lowbit.formats.numerics import INT4_MAX, amax, pack_int4_rows, unpack_int4_rows


class W4A16Awq(Format):
    name = "W4A16_AWQ"
    tensors = Tensors(("weight", "weight_scale"), ("pre_quant_scale",))
    kernel = "int4"
    shard_dims = GROUP_SHARD_DIMS  # per-group scales split with the input features too
    calibration = Calibration("INT4_AWQ_CFG", ("awq_lite", "awq_clip", "awq_full", "rtn"),
                              {"rtn": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}, group_required=True,
                              roundings=("nearest", "gptq"), modelopt_layer_format="int4_awq")

    def shape(self, t: dict) -> tuple[int, int]:
        rows, inp = t["weight"].shape
        return 2 * int(rows), int(inp)

    def group(self, t: dict) -> int:
        """The group size: in_features per weight_scale column."""
        return t["weight"].shape[1] // t["weight_scale"].shape[1]

    def dequantize(self, t: dict) -> torch.Tensor:
        q = unpack_int4_rows(t["weight"]).float()
        scale = t["weight_scale"].float()  # [out, in/group]
        return q * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        w = w.float()
        n, k = w.shape
        groups = w.reshape(n, k // group, group)
        t = {"weight_scale": amax(groups, 2) / INT4_MAX}
        q = (groups / t["weight_scale"][:, :, None]).round().clamp(-8, 7).reshape(n, k).to(torch.int8)
        t["weight"] = pack_int4_rows(q)
        if smooth is not None:
            t["pre_quant_scale"] = smooth
        return t


W4A16_AWQ = register(W4A16Awq())
