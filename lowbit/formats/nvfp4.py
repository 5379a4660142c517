"""NVFP4: e2m1 weight (uint8 [out, in/2], even element in the low nibble), e4m3 block scales [out, in/16] (row-major,
not swizzled), fp32 weight_scale_2 = amax/(6*448); activations dynamic in blocks of 16 under the static global
input_scale = amax_x/(6*448). q/k/v and gate/up share weight_scale_2 and input_scale.

Hopper has no FP4 tensor cores: lowbit's kernels serve NVFP4 there weight-only (W4A16_NVFP4's math).
"""
import torch

from lowbit.formats.base import ACT_BLOCK, GROUP_SHARD_DIMS, Calibration, Format, Tensors, register
from lowbit.formats.numerics import (E2M1_MAX, FP8_MAX, NVFP4_BLOCK, amax, fake_quant_nvfp4, nvfp4_dequantize,
                                     nvfp4_quantize, pack_e2m1, unpack_e2m1)


class Nvfp4(Format):
    name = "NVFP4"
    tensors = Tensors(("weight", "weight_scale", "weight_scale_2", "input_scale"))
    weight_only = False
    activation = ACT_BLOCK
    kernel = "nvfp4"
    shard_dims = GROUP_SHARD_DIMS  # per-group scales split with the input features too
    calibration = Calibration("NVFP4_DEFAULT_CFG", ("max",), block=NVFP4_BLOCK,
                              modelopt_layer_format="nvfp4")

    def shape(self, t: dict) -> tuple[int, int]:
        out, half = t["weight"].shape
        return int(out), 2 * int(half)

    def dequantize(self, t: dict) -> torch.Tensor:
        return nvfp4_dequantize(unpack_e2m1(t["weight"]), t["weight_scale"], t["weight_scale_2"])

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        w = w.float()
        global_amax = amax(w) if w_amax is None else torch.tensor(w_amax, device=w.device)
        t = {"weight_scale_2": global_amax / (E2M1_MAX * FP8_MAX)}
        codes, t["weight_scale"] = nvfp4_quantize(w, t["weight_scale_2"])
        t["weight"] = pack_e2m1(codes)
        if not self.weight_only:
            t["input_scale"] = torch.tensor(x_amax / (E2M1_MAX * FP8_MAX))
        return t

    def _quantize_input(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        return fake_quant_nvfp4(x, t["input_scale"].float()).to(x.dtype)


NVFP4 = register(Nvfp4())
