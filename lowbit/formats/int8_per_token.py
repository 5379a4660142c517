"""INT8_PER_CHANNEL_PER_TOKEN: int8 weight [-127, 127] with fp32 weight_scale [out]; activations dynamic per token,
x_q = round(x / s) clamped to [-127, 127] with s = amax(|row|) / 127 per row (as vLLM's dynamic int8 quantization;
compressed-tensors' own fake quant divides by 127.5). llm-compressor's W8A8 preset; lowbit reads and serves it but
does not make it (no modelopt quant_algo)."""
import torch

from lowbit.formats.base import ACT_PER_TOKEN, Format, Tensors, register
from lowbit.formats.numerics import fake_quant_int8_per_token, quantize_int8_per_channel


class Int8PerToken(Format):
    name = "INT8_PER_CHANNEL_PER_TOKEN"
    tensors = Tensors(("weight", "weight_scale"), ("input_scale",))  # an input_scale is ignored
    weight_only = False
    activation = ACT_PER_TOKEN
    kernel = "int8"
    dynamic_per_token = True

    def dequantize(self, t: dict) -> torch.Tensor:
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1)

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        t = quantize_int8_per_channel(w)
        return t

    def _quantize_input(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        return fake_quant_int8_per_token(x).to(x.dtype)


INT8_PER_CHANNEL_PER_TOKEN = register(Int8PerToken())
