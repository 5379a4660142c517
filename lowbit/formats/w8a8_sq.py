"""W8A8_SQ_PER_CHANNEL (SmoothQuant): int8 weight [-127, 127] with fp32 weight_scale [out]; static int8
activations over the full range [-128, 127] with one fp32 input_scale; pre_quant_scale [in] (model dtype) on every
linear."""
import torch

from lowbit.formats.base import ACT_STATIC, Calibration, Format, Tensors, register
from lowbit.formats.numerics import INT8_MAX, fake_quant_int8, quantize_int8_per_channel


class W8A8SmoothQuant(Format):
    name = "W8A8_SQ_PER_CHANNEL"
    tensors = Tensors(("weight", "weight_scale", "input_scale", "pre_quant_scale"))
    weight_only = False
    activation = ACT_STATIC
    kernel = "int8"
    calibration = Calibration("INT8_SMOOTHQUANT_CFG", ("smoothquant",))

    def dequantize(self, t: dict) -> torch.Tensor:
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1)

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        t = quantize_int8_per_channel(w)
        t["input_scale"] = torch.tensor(x_amax / INT8_MAX)
        t["pre_quant_scale"] = smooth if smooth is not None else torch.ones(w.shape[1], dtype=torch.bfloat16)
        return t

    def _quantize_input(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        return fake_quant_int8(x, t["input_scale"].float()).to(x.dtype)


W8A8_SQ_PER_CHANNEL = register(W8A8SmoothQuant())
