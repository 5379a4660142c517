"""Gated activations of a merged gate/up output (SiLU, GeGLU's gelu-tanh), optionally writing FP8 for the next linear."""
import torch
from torch import nn

from lowbit.serve.layers import ops


class SiluAndMul(nn.Module):
    gemv_epilogue = True  # an unquantized gate/up GEMV at one row may run this in its epilogue (Linear(silu_mul=True))

    def forward(self, gate_up: torch.Tensor, quant_scale: torch.Tensor | None = None,
                up_scale: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up [T, 2 * inter] -> silu(gate) * up [T, inter] (float8_e4m3fn, out / quant_scale, if given).

        up_scale: fp32 0-d, multiplies up first (a merged gate/up layer's deferred part_scales[1]).
        """
        return ops.silu_and_mul(gate_up, quant_scale, up_scale)


class GeluTanhAndMul(nn.Module):
    """GeGLU (HF hidden_activation gelu_pytorch_tanh): gelu(gate, approximate="tanh") * up, as SiluAndMul."""
    gemv_epilogue = False  # the GEMV epilogue computes SiLU only

    def forward(self, gate_up: torch.Tensor, quant_scale: torch.Tensor | None = None,
                up_scale: torch.Tensor | None = None) -> torch.Tensor:
        return ops.gelu_tanh_and_mul(gate_up, quant_scale, up_scale)


ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}  # HF hidden_act / hidden_activation


def gated_activation(name: str) -> nn.Module:
    """The gated activation for an HF activation name; ValueError naming an unsupported one."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()
