"""The unquantized format: a float weight, no scales; also what None and the plain dtype names resolve to."""
import torch

from lowbit.formats.base import Format, register


class Plain(Format):
    name = "bf16"
    kernel = "dense"

    def dequantize(self, t: dict) -> torch.Tensor:
        return t["weight"].float()

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        return {"weight": w.to(torch.bfloat16)}

    def _merge_weight_scale(self, merged: dict, parts: list[dict]) -> None:
        """No weight scale: a part that has one is left over and refused by merge."""


BF16 = register(Plain(), aliases=(None, "BF16", "fp16", "FP16", "none"))
