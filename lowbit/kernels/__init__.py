"""lowbit's kernels: Triton on NVIDIA GPUs, each beside a torch reference of the same signature.

The serving engine calls only what is exported here; see docs/kernels_notes.md for layouts and measurements.
"""
from lowbit.kernels._triton import HAS_TRITON, all_kernels_early
from lowbit.kernels.activation import silu_and_mul, silu_and_mul_ref
from lowbit.kernels.decode_inputs import load_decode_inputs, merge_pending
from lowbit.kernels.dense_gemv import dense_linear
from lowbit.kernels.norm import quantize_fp8_ref, rms_norm, rms_norm_ref
from lowbit.kernels.paged_attention import (decode_splits, gather_kv, long_context, paged_decode, store_kv,
                                            store_kv_ref)
from lowbit.kernels.paged_prefill import paged_prefill
from lowbit.kernels.qlinear import PreparedLinear, linear, linear_ref, prepare_linear
from lowbit.kernels.rotary import rotary, rotary_qk_ref, rotary_ref
from lowbit.kernels.rotary_kv import rotary_store_kv
from lowbit.kernels.sampling import argmax_rows, exponential_noise

__all__ = ["PreparedLinear", "prepare_linear", "linear", "linear_ref", "dense_linear", "rms_norm", "rms_norm_ref",
           "rotary", "rotary_ref", "rotary_qk_ref", "silu_and_mul", "silu_and_mul_ref", "store_kv", "store_kv_ref",
           "gather_kv", "paged_decode", "decode_splits", "long_context", "paged_prefill", "rotary_store_kv",
           "all_kernels_early", "load_decode_inputs", "merge_pending", "argmax_rows", "exponential_noise",
           "quantize_fp8_ref", "HAS_TRITON"]
