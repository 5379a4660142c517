"""FP8_PER_CHANNEL_PER_TOKEN: float8_e4m3fn weight, fp32 weight_scale [out]; activations dynamic per token."""
import torch

from lowbit.formats.base import ACT_PER_TOKEN, Calibration, Format, Tensors, register
from lowbit.formats.numerics import FP8_MAX, amax, fake_quant_fp8_per_token


class Fp8PerToken(Format):
    name = "FP8_PER_CHANNEL_PER_TOKEN"
    tensors = Tensors(("weight", "weight_scale"), ("input_scale",))  # an input_scale is ignored
    weight_only = False
    activation = ACT_PER_TOKEN
    kernel = "fp8"
    dynamic_per_token = True
    calibration = Calibration("FP8_PER_CHANNEL_PER_TOKEN_CFG", ("max",), modelopt_layer_format="fp8_pc_pt")

    def dequantize(self, t: dict) -> torch.Tensor:
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1)

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        w = w.float()
        t = {"weight_scale": amax(w, 1) / FP8_MAX}
        t["weight"] = (w / t["weight_scale"][:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return t

    def _quantize_input(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        return fake_quant_fp8_per_token(x).to(x.dtype)


FP8_PER_CHANNEL_PER_TOKEN = register(Fp8PerToken())
