"""RMSNorm with the residual add fused in, writing FP8 directly for a next linear that takes static FP8 input."""
import torch
from torch import nn

from lowbit.serve.layers import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None):
        """Returns normed(x + residual) and, when residual is given, the new residual x + residual.

        quant_scale: the next layer's static FP8 input_scale; the normed output is then float8_e4m3fn (out / scale).
        """
        out, res = ops.rms_norm(x, self.weight, self.eps, residual, quant_scale)
        return out if residual is None else (out, res)

    def forward_into(self, next_linear, x: torch.Tensor, residual: torch.Tensor | None):
        """A decoder layer's pre-norm -> (normed(x + residual) as next_linear takes its input, the new residual).

        next_linear: a Linear or MergedLinear; with a static FP8 input_scale the normed output is written as its
        float8_e4m3fn input (the hand-off). residual None (the first layer): x alone is normed and is the residual.
        """
        if residual is None:
            return self(x, quant_scale=next_linear.fp8_input_scale), x
        return self(x, residual, next_linear.fp8_input_scale)
