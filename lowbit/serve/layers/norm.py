"""RMSNorm with the residual add fused in, writing FP8 directly for a next linear that takes static FP8 input; Gemma's
variant scales by (1 + weight)."""
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
        out, res = ops.rms_norm(x, self.scale(), self.eps, residual, quant_scale)
        return out if residual is None else (out, res)

    def forward_into(self, next_linear, x: torch.Tensor, residual: torch.Tensor | None):
        """A decoder layer's pre-norm -> (normed(x + residual) as next_linear takes its input, the new residual).

        next_linear: a Linear or MergedLinear; with a static FP8 input_scale the normed output is written as its
        float8_e4m3fn input (the hand-off). residual None (the first layer): x alone is normed and is the residual.
        """
        if residual is None:
            return self(x, quant_scale=next_linear.fp8_input_scale), x
        return self(x, residual, next_linear.fp8_input_scale)

    def scale(self) -> torch.Tensor:
        """The per-channel multiplier [dim] the normalized x is scaled by."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalize(x) * (1 + weight), the checkpoint's weight centred on 0 and 1 + weight in float32.

    The kernels round normalize(x) to x's dtype before the multiply (HF Gemma rounds once, after it): identical in
    float32, within one rounding in bf16.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight.data.zero_()
        self._scale, self._scale_of = None, None

    def scale(self) -> torch.Tensor:
        """1 + weight in float32 [dim], recomputed only when the loader has replaced or changed the weight (a
        CUDA graph captures the cached tensor: its warm-up forward runs first)."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.device)
        if key != self._scale_of:
            self._scale, self._scale_of = 1.0 + w.float(), key
        return self._scale
