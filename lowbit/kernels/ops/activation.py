"""Gated activations of the gate/up projection: x [..., 2*D] -> act(x[..., :D]) * x[..., D:]  [..., D], with act
SiLU (Llama, Qwen) or GELU's tanh approximation (GeGLU: Gemma's gelu_pytorch_tanh), one kernel for both.

With quant_scale (the down projection's static FP8 input_scale) the output is float8_e4m3fn, out / quant_scale (the
kernel multiplies by 1 / quant_scale, as lowbit.kernels.ops.norm does).
With up_scale (fp32, 0-d or 1 element: a merged gate/up layer's deferred weight-scale ratio) up is multiplied by it
in fp32 first: silu(gate) * (up * up_scale), rounded to x's dtype once.
"""
import torch
import torch.nn.functional as F

from lowbit.kernels import tuning
from lowbit.kernels._triton import cdiv, kernel, on_gpu, tl, wait_for_producers
from lowbit.kernels.ops.norm import quantize_fp8_ref

ACTIVATIONS = ("silu", "gelu_tanh")  # the kernel's ACT constexpr is the index


def silu_and_mul_ref(x: torch.Tensor, quant_scale: torch.Tensor | None = None,
                     up_scale: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul_ref(F.silu, x, quant_scale, up_scale)


def gelu_tanh_and_mul_ref(x: torch.Tensor, quant_scale: torch.Tensor | None = None,
                          up_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up in fp32, rounded once to x's dtype (HF rounds gelu(gate) to the dtype first)."""
    return _act_and_mul_ref(lambda g: F.gelu(g, approximate="tanh"), x, quant_scale, up_scale)


def _act_and_mul_ref(act, x, quant_scale, up_scale) -> torch.Tensor:
    d = x.shape[-1] // 2
    up = x[..., d:].float() if up_scale is None else x[..., d:].float() * up_scale.float().reshape(())
    out = (act(x[..., :d].float()) * up).to(x.dtype)
    return out if quant_scale is None else quantize_fp8_ref(out, quant_scale)


@kernel
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, up_scale_ptr, D, QUANT: tl.constexpr, UP_SCALED: tl.constexpr,
                         ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * D + D + cols, mask=mask, other=0.0).to(tl.float32)
    if UP_SCALED:
        up = up * tl.load(up_scale_ptr).to(tl.float32)
    if ACT == 0:  # silu
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    else:  # gelu tanh: 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (1 + exp(2u)) (exp's overflow to inf gives 1)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (g + 0.044715 g^3)
        y = (0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * u))) * up).to(x_ptr.dtype.element_ty)
    if QUANT:
        inv = tl.div_rn(1.0, tl.load(scale_ptr))  # one division per program, not per element
        v = tl.minimum(tl.maximum(y.to(tl.float32) * inv, -448.0), 448.0)
        tl.store(out_ptr + row * D + cols, v.to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptr + row * D + cols, y, mask=mask)


def silu_and_mul(x: torch.Tensor, quant_scale: torch.Tensor | None = None,
                 up_scale: torch.Tensor | None = None) -> torch.Tensor:
    if not on_gpu(x):
        return silu_and_mul_ref(x, quant_scale, up_scale)
    return silu_and_mul_triton(x, quant_scale, up_scale)


def gelu_tanh_and_mul(x: torch.Tensor, quant_scale: torch.Tensor | None = None,
                      up_scale: torch.Tensor | None = None) -> torch.Tensor:
    if not on_gpu(x):
        return gelu_tanh_and_mul_ref(x, quant_scale, up_scale)
    return silu_and_mul_triton(x, quant_scale, up_scale, act="gelu_tanh")


def silu_and_mul_triton(x: torch.Tensor, quant_scale: torch.Tensor | None = None,
                        up_scale: torch.Tensor | None = None, config: tuple[int, int] | None = None,
                        act: str = "silu") -> torch.Tensor:
    """act: one of ACTIVATIONS (the gate's activation)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    out_dtype = x.dtype if quant_scale is None else torch.float8_e4m3fn
    out = torch.empty(x2.shape[0], d, dtype=out_dtype, device=x.device)
    if up_scale is not None and up_scale.numel() != 1:
        raise ValueError(f"up_scale must hold one value, got shape {tuple(up_scale.shape)}")
    block, warps = config or tuning.current().silu_config
    _silu_and_mul_kernel[(x2.shape[0], cdiv(d, block))](
        x2, out, quant_scale if quant_scale is not None else x2, up_scale if up_scale is not None else x2, d,
        QUANT=quant_scale is not None, UP_SCALED=up_scale is not None, BLOCK=block, ACT=ACTIVATIONS.index(act),
        num_warps=warps)
    return out.reshape(*x.shape[:-1], d)
