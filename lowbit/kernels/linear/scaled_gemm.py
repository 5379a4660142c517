"""W8A8 GEMM with a dequantizing epilogue: out[M, N] = (a @ b^T) * scale_a * scale_b (+ bias), in out_dtype.

a [M, K] and b [N, K] (both K-contiguous) are int8 (int32 accumulation) or float8_e4m3fn (fp32 accumulation);
scale_a is fp32 [] (per tensor) or [M, 1] (per token); scale_b is fp32 [] or [N] (per output channel).
Used for INT8 SmoothQuant, and for FP8 where torch._scaled_mm does not apply.
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels._triton import cdiv, kernel, tl, use_triton, wait_for_producers


def scaled_gemm_ref(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    acc = a.float() @ b.float().t()
    out = acc * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@kernel
def _scaled_gemm_kernel(a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                        SA_PER_ROW: tl.constexpr, SB_PER_COL: tl.constexpr, HAS_BIAS: tl.constexpr,
                        IS_INT: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        PDL: tl.constexpr):
    # grouped launch order: GROUP_M row-blocks share each column-block, so b tiles are reused from L2
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    n_blocks_m = tl.cdiv(M, BLOCK_M)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_blocks_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(n_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_blocks_n)) % group_size
    pid_n = (pid % (GROUP_M * n_blocks_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped rows: loads stay in bounds, stores are masked
    b_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + b_rows[:, None] * K + offs_k[None, :]
    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask, other=0.0)
            b = tl.load(b_ptrs, mask=k_mask, other=0.0)
        if IS_INT:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    out = acc.to(tl.float32)
    if SA_PER_ROW:
        out = out * tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    else:
        out = out * tl.load(sa_ptr)
    if SB_PER_COL:
        out = out * tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    else:
        out = out * tl.load(sb_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def choose_config(M: int) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the first of Tuning.scaled_gemm_configs whose M fits."""
    return next(config for max_m, config in tuning.current().scaled_gemm_configs if max_m is None or M <= max_m)


def scaled_gemm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, config=None):
    if not use_triton(a):
        return scaled_gemm_ref(a, b, scale_a, scale_b, bias, out_dtype)
    M, K = a.shape
    N = b.shape[0]
    block_m, block_n, block_k, warps, stages = config or choose_config(M)
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _scaled_gemm_kernel[grid](
        a, b, out, scale_a, scale_b, bias if bias is not None else scale_b, M, N, K,
        SA_PER_ROW=scale_a.numel() > 1, SB_PER_COL=scale_b.numel() > 1, HAS_BIAS=bias is not None,
        IS_INT=a.dtype == torch.int8, EVEN_K=K % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out
