"""RMSNorm with the residual add fused in: out = weight * normalize(x + residual), new_residual = x + residual."""
import torch

from lowbit.kernels._triton import kernel, next_pow2, on_gpu, tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual [..., D]; weight [D]. Rounds like HF Llama: the sum and the normalized x in x's dtype."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype), x


@kernel
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype).to(tl.float32)
        tl.store(res_out_ptr + row * D + cols, x.to(dtype), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (normed * w).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """-> (out, new_residual): new_residual = x + residual, or x itself when residual is None."""
    if not on_gpu(x):
        return rms_norm_ref(x, weight, eps, residual)
    return rms_norm_triton(x, weight, eps, residual)


def rms_norm_triton(x, weight, eps, residual=None):
    shape = x.shape
    D = shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    out = torch.empty_like(x2)
    if residual is None:
        res2, res_out = x2, x2
    else:
        res2 = residual.reshape(-1, D).contiguous()
        res_out = torch.empty_like(x2)
    block = next_pow2(D)
    _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight, out, res_out, D, eps,
                                     HAS_RESIDUAL=residual is not None, BLOCK=block,
                                     num_warps=min(16, max(1, block // 512)))
    return out.reshape(shape), (x if residual is None else res_out.reshape(shape))
