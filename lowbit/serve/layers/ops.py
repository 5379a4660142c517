"""The kernel ops the layers call per step, in one namespace: a reference path swaps them here by name.

Each is lowbit.kernels' Triton kernel on the GPU and its torch reference elsewhere; the layers call them as
`ops.rms_norm(...)` (never a name bound at import), so a swap reaches every layer.
"""
from lowbit.kernels import dense_linear, gelu_tanh_and_mul, linear as quant_linear, rms_norm, rotary, silu_and_mul
from lowbit.kernels import fused_moe, moe_route, moe_router

__all__ = ["dense_linear", "quant_linear", "rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul", "fused_moe",
           "moe_route", "moe_router"]
