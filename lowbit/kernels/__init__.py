"""lowbit's kernels: Triton on NVIDIA GPUs, each beside a torch reference of the same signature.

The serving engine calls only what is exported here; see docs/kernels_notes.md for layouts and measurements.
"""
from lowbit.kernels.activation import silu_and_mul, silu_and_mul_ref
from lowbit.kernels.dense_gemv import dense_linear
from lowbit.kernels.qlinear import PreparedLinear, linear, linear_ref, prepare_linear
from lowbit.kernels.norm import rms_norm, rms_norm_ref
from lowbit.kernels.rotary import rotary, rotary_qk_ref, rotary_ref

__all__ = ["PreparedLinear", "prepare_linear", "linear", "linear_ref", "dense_linear", "rms_norm", "rms_norm_ref",
           "rotary", "rotary_ref", "rotary_qk_ref", "silu_and_mul", "silu_and_mul_ref"]
