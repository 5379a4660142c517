"""Transformer sub-blocks with the kernel fusions and their hand-offs inside: self-attention and the gated MLP.

Activations are flattened: [T, hidden] for the T new tokens of all sequences in the step.
"""
import torch
from torch import nn

from lowbit.serve.layers.activation import SiluAndMul
from lowbit.serve.layers.attention import Attention
from lowbit.serve.layers.linear import Linear, MergedLinear
from lowbit.serve.layers.norm import RMSNorm
from lowbit.serve.layers.rotary import RotaryEmbedding
from lowbit.serve.runner.context import StepContext


class SelfAttention(nn.Module):
    """qkv_proj (q/k/v merged) -> [per-head q/k RMSNorm] -> rotary -> K/V store -> paged attention -> o_proj.

    Rotary and the K/V store run in one backend call straight from the qkv rows, the per-head q/k RMSNorms too where
    the model has them; without them the call applies qkv_proj's deferred FP8 part_scales (with them qkv_proj merges
    per row instead: an RMSNorm before RoPE would absorb a ratio). When o_proj is static FP8, attention writes its
    output as o_proj's float8_e4m3fn input.
    sliding_window, logit_softcap, scale: the attention's (layers.attention.Attention).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 sliding_window: int | None = None, logit_softcap: float | None = None, scale: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qk_norm = qk_norm_eps is not None
        self.qkv_proj = MergedLinear(hidden, [q_size, kv_size, kv_size], qkv_bias, ["q_proj", "k_proj", "v_proj"],
                                     defer_part_scales=not qk_norm)
        self.o_proj = Linear(q_size, hidden, o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm else None
        self.rotary = [rotary]  # shared by every layer, and kept out of this module's children
        self.attn = Attention(num_heads, num_kv_heads, head_dim, sliding_window, logit_softcap, scale)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """hidden [T, hidden] (float8_e4m3fn when qkv_proj takes static FP8 input) -> [T, hidden]."""
        qkv = self.qkv_proj(hidden)
        qk_norm = None if self.q_norm is None else (self.q_norm.scale(), self.k_norm.scale(), self.q_norm.eps)
        return self.o_proj(self.attn.forward_qkv(qkv, self.rotary[0].cos_sin_cache, self.qkv_proj.part_scales, ctx,
                                                 self.o_proj.fp8_input_scale, qk_norm))


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), with gate/up merged into one GEMM (gate_up_proj); act: SiLU unless
    given (a gated activation module of layers.activation, e.g. GeluTanhAndMul).

    The SiLU-and-multiply applies gate_up_proj's deferred FP8 part_scales (up's ratio) and, when down_proj is static
    FP8, writes down_proj's float8_e4m3fn input; with neither, the merged layer runs it in its own epilogue.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: nn.Module | None = None):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias, ["gate_proj", "up_proj"],
                                         defer_part_scales=True)
        self.down_proj = Linear(intermediate, hidden, bias)
        self.act = SiluAndMul() if act is None else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (float8_e4m3fn when gate_up_proj takes static FP8 input) -> [T, hidden]."""
        return self.down_proj(self.gate_up_act(x))

    def gate_up_act(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> act(gate) * up [T, intermediate], as down_proj takes its input."""
        gate_up, quant_scale = self.gate_up_proj, self.down_proj.fp8_input_scale
        part_scales = gate_up.part_scales
        if gate_up.parts is None and part_scales is None and quant_scale is None and self.act.gemv_epilogue:
            return gate_up.merged(x, silu_mul=True)  # unquantized at one row on the GPU: SiLU in the GEMV's epilogue
        up_scale = None if part_scales is None else part_scales[1]
        return self.act(gate_up(x), quant_scale, up_scale)
