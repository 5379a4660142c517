"""SiLU-and-multiply of the gate/up projection: x [..., 2*D] -> silu(x[..., :D]) * x[..., D:]  [..., D]."""
import torch
import torch.nn.functional as F

from lowbit.kernels._triton import cdiv, kernel, on_gpu, tl

_BLOCK = 1024


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


@kernel
def _silu_and_mul_kernel(x_ptr, out_ptr, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * 2 * D + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * D + D + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * D + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not on_gpu(x):
        return silu_and_mul_ref(x)
    return silu_and_mul_triton(x)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(x2.shape[0], cdiv(d, _BLOCK))](x2, out, d, BLOCK=_BLOCK, num_warps=4)
    return out.reshape(*x.shape[:-1], d)
