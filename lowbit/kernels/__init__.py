"""lowbit's kernels, the public face: Triton on NVIDIA GPUs, each op beside a torch reference of the same signature.

The serving engine imports only the names exported here (`from lowbit.kernels import NAME`); the subpackages
(linear/, attention/, ops/, routes, tuning) are internals for tests and benchmarks. `import lowbit.kernels` works
without triton (every op then runs its torch reference) and stays cheap: the linear layer's names are bound here,
the rest load on first use.
"""
import importlib

# Bound eagerly: importing the subpackage lowbit.kernels.linear sets this package's attribute `linear` to it, and this
# import runs after that, so `linear` is the function. (So reach linear-layer internals with
# `from lowbit.kernels.linear import MODULE`, not `import lowbit.kernels.linear.MODULE as m`.)
from lowbit.kernels.linear.qlinear import PreparedLinear, linear, linear_ref, prepare_linear

_WHERE = {
    "lowbit.kernels.linear.dense_gemv": ("dense_linear",),
    "lowbit.kernels.ops.norm": ("rms_norm", "rms_norm_ref", "quantize_fp8_ref"),
    "lowbit.kernels.ops.rotary": ("rotary", "rotary_ref", "rotary_qk_ref"),
    "lowbit.kernels.ops.activation": ("silu_and_mul", "silu_and_mul_ref", "gelu_tanh_and_mul",
                                      "gelu_tanh_and_mul_ref"),
    "lowbit.kernels.ops.sampling": ("argmax_rows", "exponential_noise"),
    "lowbit.kernels.ops.decode_inputs": ("load_decode_inputs", "merge_pending"),
    "lowbit.kernels.attention.paged_attention": ("store_kv", "store_kv_ref", "gather_kv", "v_blocks", "paged_decode",
                                                 "decode_splits", "long_context", "attention_ref", "window_start"),
    "lowbit.kernels.attention.paged_prefill": ("paged_prefill",),
    "lowbit.kernels.attention.rotary_kv": ("rotary_store_kv", "qk_norm_ref"),
    "lowbit.kernels.moe.fused_moe": ("fused_moe", "fused_moe_ref", "Fp8Scales", "Int4Scales", "Int8Scales",
                                   "Nvfp4Scales"),
    "lowbit.kernels.moe.route": ("moe_route", "moe_route_ref", "moe_router", "moe_router_ref"),
    "lowbit.kernels._triton": ("all_kernels_early", "HAS_TRITON"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = ["PreparedLinear", "prepare_linear", "linear", "linear_ref", *_MODULE_OF]


def __getattr__(name: str):
    """Loads an exported name from its module on first use (PEP 562) and keeps it here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
