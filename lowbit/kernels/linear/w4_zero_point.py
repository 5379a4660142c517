"""Zero-point int4 (W4A16_ZP) on the W4 kernels: where the routes give the GEMV or w4_mma, it subtracts the zero
points from the codes itself (lowbit.kernels.linear.w4_gemv / w4_mma, routes "zp_gemv" / "zp_mma": one launch, no
correction); elsewhere the symmetric kernels run and a correction in fp32 follows: y = W_sym x - correction.

With codes q in [-8, 7], zero points z and scales s per (row n, group g):
    y[m, n] = sum_k (q - z) s x[m, k] = (W_sym x)[m, n] - sum_g zs[g, n] * S[m, g],
where W_sym = q * s is what every W4 kernel computes (nibble u = q + 8), zs = s * z fp32 [K/group, N] (built once at
load) and S[m, g] = sum of x's group g (after pre_quant_scale, rounded to x's dtype as the kernels round it).
routes.ZERO_POINT picks how the zero points join the W4 kernel's output:
- "zp_gemv" / "zp_mma": no correction: the kernel reads z (int8 [KP/group, N], the scales' layout) and sums
  (q - z) x (the GEMV per 32-wide chunk in fp32, w4_mma with q - z in the mma's A registers);
- "zp_bias": one x row: bias - S @ zs is an fp32 vector [N], passed to the W4 kernel as its bias (every W4 kernel
  adds an fp32 bias before rounding), so the cancellation of the two terms happens in fp32 inside the kernel;
- "zp_add": a few rows: one Triton launch adds -S @ zs to the W4 kernel's output in place (fp32 math, one rounding);
- "zp_addmm": many rows: torch's group sums and fp32 addmm.
On the add paths W_sym x is rounded once to x's dtype before the correction: error ~ one output ulp of |W_sym x|,
which is of the size of |y| (codes and zero points are both centred on 0).
"""
import torch

from lowbit.kernels import routes
from lowbit.kernels._triton import cdiv, kernel, next_pow2, tl, wait_for_producers
from lowbit.kernels.linear import w4_gemv, w4_mma

CHUNK = 128  # x elements summed per chunk: a group is one chunk (groups of 16-128) or several (multiples of 128)
BLOCK_N = 128
CHUNK_ELEMS = 2048  # x elements one loop step loads (chunks per step x CHUNK)


def zero_scale(weight_scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K/group] scales and zero points -> zs fp32 [K/group, N] = scale * zero_point (one rounding)."""
    return (weight_scale.float() * zero_point.float()).t().contiguous()


def group_sums(x: torch.Tensor, smooth: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] -> S fp32 [M, K/group]; x * smooth is rounded to x's dtype first, as the W4 kernels do."""
    if smooth is not None:
        x = x * smooth.to(x.dtype)
    return x.float().reshape(x.shape[0], -1, group).sum(-1)


def correction_ref(x, smooth, zs: torch.Tensor, group: int) -> torch.Tensor:
    """S @ zs: fp32 [M, N], the term subtracted from W_sym x."""
    return group_sums(x, smooth, group) @ zs.to(x.device)


def zp_gemm(x: torch.Tensor, w, bias, sym_gemm) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype for a W4Weight w with zero points; sym_gemm(x, bias) runs the symmetric
    W4 kernel on w's codes and scales (lowbit.kernels.linear.w4a16)."""
    M = x.shape[0]
    how = routes.route("zero_point", w.fmt, M, w.out_features, w.in_features, None, group=w.group,
                       x16=x.dtype in (torch.bfloat16, torch.float16))
    if how == "zp_gemv":
        return w4_gemv.w4_gemv(x, w, bias, zero_point=w.zero_point)
    if how == "zp_mma":
        return w4_mma.w4_mma(x, w, bias, zero_point=w.zero_point)
    if how == "zp_bias":
        return sym_gemm(x, correct(x, w, bias))
    y = sym_gemm(x, bias)
    if how == "zp_add":
        return correct(x, w, None, y)
    c = group_sums(x, w.smooth, w.group)
    return torch.addmm(y.float(), c, w.zero_scale, alpha=-1).to(y.dtype)


def correct(x: torch.Tensor, w, bias=None, y=None) -> torch.Tensor:
    """One launch: y - S @ zs in place (y [M, N] given), or bias - S @ zs as fp32 [N] (M = 1, no y)."""
    x = x.contiguous()
    M, K = x.shape
    N = w.out_features
    assert y is not None or M == 1, "without y the correction is one row (a bias)"
    out = y if y is not None else torch.empty(N, dtype=torch.float32, device=x.device)
    chunk = min(w.group, CHUNK)
    grid = (cdiv(N, BLOCK_N), M)
    _correction_kernel[grid](
        x, w.smooth if w.smooth is not None else x, w.zero_scale, bias if bias is not None else x, out, N, K,
        GROUP=w.group, CH=chunk, BLOCK_C=next_pow2(max(1, CHUNK_ELEMS // chunk)), BLOCK_N=BLOCK_N,
        HAS_SMOOTH=w.smooth is not None, HAS_BIAS=bias is not None, HAS_Y=y is not None, num_warps=4)
    return out


@kernel
def _correction_kernel(x_ptr, smooth_ptr, zs_ptr, bias_ptr, out_ptr, N, K, GROUP: tl.constexpr, CH: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_Y: tl.constexpr, PDL: tl.constexpr):
    """Program (n block, row m): acc [BLOCK_N] = sum over CH-wide chunks c of x's row m of sum(x chunk) * zs[c's
    group, n]; then out[m, n] = y[m, n] - acc (HAS_Y, in place) or out[n] = bias[n] - acc, in fp32."""
    wait_for_producers(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    n_ok = offs_n < N
    n_chunks = K // CH
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < n_chunks
        k = c[:, None] * CH + tl.arange(0, CH)[None, :]  # [BLOCK_C, CH]
        xs = tl.load(x_ptr + m * K + k, mask=c_ok[:, None], other=0.0)
        if HAS_SMOOTH:  # x * pre_quant_scale rounded to x's dtype, as the W4 kernels
            sm = tl.load(smooth_ptr + k, mask=c_ok[:, None], other=0.0).to(xs.dtype).to(tl.float32)
            xs = (xs.to(tl.float32) * sm).to(xs.dtype)
        s = tl.sum(xs.to(tl.float32), axis=1)  # [BLOCK_C]
        zs = tl.load(zs_ptr + (c // (GROUP // CH))[:, None] * N + offs_n[None, :],
                     mask=c_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_C, BLOCK_N]
        acc += tl.sum(s[:, None] * zs, axis=0)
    if HAS_Y:
        ptrs = out_ptr + m * N + offs_n
        tl.store(ptrs, (tl.load(ptrs, mask=n_ok, other=0.0).to(tl.float32) - acc).to(out_ptr.dtype.element_ty),
                 mask=n_ok)
    else:
        if HAS_BIAS:
            acc -= tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, -acc, mask=n_ok)
