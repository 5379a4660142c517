"""SiLU-and-multiply of a merged gate/up output, optionally writing FP8 for the next linear."""
import torch
from torch import nn

from lowbit.serve.layers import ops


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor, quant_scale: torch.Tensor | None = None,
                up_scale: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up [T, 2 * inter] -> silu(gate) * up [T, inter] (float8_e4m3fn, out / quant_scale, if given).

        up_scale: fp32 0-d, multiplies up first (a merged gate/up layer's deferred part_scales[1]).
        """
        return ops.silu_and_mul(gate_up, quant_scale, up_scale)
