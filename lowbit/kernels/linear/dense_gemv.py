"""Decode (M = 1) GEMV for weights stored one element per 1-2 bytes: bf16 / fp16 (dense_gemv, as stored), and FP8
e4m3 with an FP8 x and fp32 scales (fp8_gemv; y = (q @ W^T) * scale_a * scale_b). CUDA cores, fp32 sums.

Each program owns BLOCK_N output rows over all of K. A K step is C = BLOCK_K / VEC chunks of VEC = 16 bytes of
elements per row; chunk c goes to thread c mod (32 x num_warps), and a thread holds every row of its chunks: one
16-byte load per row and chunk (.cg: L2 only) and one x load per chunk, shared by the rows (the same register layout
as lowbit.kernels.linear.w4_gemv's words). The next step's weights are loaded while this step is computed; the
first step is loaded before the PDL wait (lowbit.kernels._triton), so its weights stream while the kernel before
finishes.
Per weight: one conversion to fp32 and one FMA. bf16 is bound by HBM (3.4-4.4 TB/s on the H200); FP8's conversion
takes ~5 instructions per weight offline, so it may be bound by issue. One row only: at M = 2 cuBLAS is faster.
silu_mul: a merged gate/up GEMV stores silu(gate) x up (one launch fewer per layer at batch 1).
"""
import torch
import torch.nn.functional as F

from lowbit.kernels import routes, tuning
from lowbit.kernels._triton import (capability, cdiv, early_kernel, load_streamed, on_gpu, tl, use_triton,
                                    wait_for_producers)
from lowbit.kernels.ops.activation import silu_and_mul, silu_and_mul_ref


def gemv_config(n: int, element_size: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for N output rows of element_size-byte weights."""
    t = tuning.current()
    return (4 if cdiv(n, 4) <= t.dense_gemv_max_programs_at_4_rows else 8), t.dense_gemv_step_bytes // element_size, \
        t.dense_gemv_warps


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias), run by the GEMV when x is one bf16 / fp16 row on the GPU (decode at batch 1).
    silu_mul: weight is a merged gate/up [2D, K] and the result silu_and_mul of it, [..., D] (one launch at one row:
    the GEMV's epilogue)."""
    if not on_gpu(x):  # no GPU kernel applies (routes.route with arch None): torch's GEMM, without the lookup
        y = F.linear(x, weight, bias)
        return silu_and_mul(y) if silu_mul else y
    x16 = x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    arch = capability(x.device)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if routes.route("linear", "dense", rows, weight.shape[0], weight.shape[-1], arch, x16=x16) == "dense_gemv":
        return dense_gemv(x.reshape(1, -1), weight, bias, silu_mul=silu_mul).reshape(*x.shape[:-1], -1)
    y = F.linear(x, weight, bias)
    return silu_and_mul(y) if silu_mul else y


def dense_gemv(x, weight, bias=None, config=None, silu_mul=False):
    """x [1, K] bf16/fp16, weight [N, K] of x's dtype -> [1, N] in x's dtype (fp32 sums).
    config (BLOCK_N, BLOCK_K, num_warps), default gemv_config(N); BLOCK_K / 8 a multiple of 32 x num_warps.
    silu_mul: weight is a merged gate/up [2D, K]; the output is silu_and_mul of the GEMV's [1, 2D] output, [1, D]
    (each program takes BLOCK_N / 2 gate rows and the matching up rows)."""
    assert x.shape[0] == 1 and weight.dtype == x.dtype and weight.shape[1] == x.shape[1], (x.shape, weight.shape)
    return _launch(x, weight, None, None, bias, x.dtype, config, silu_mul)


def dense_gemv_ref(x, weight, bias=None, silu_mul=False):
    """dense_gemv's contract in torch."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return silu_and_mul_ref(y) if silu_mul else y


def fp8_gemv(q, weight, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, config=None):
    """q [1, K] float8_e4m3fn (x ~= q * scale_a), weight [N, K] float8_e4m3fn; scale_a fp32 [] or [1, 1], scale_b
    fp32 [] or [N] -> [1, N] out_dtype: (q @ W^T) * scale_a * scale_b (+ bias), as scaled_gemm_ref (fp32 math).
    config as dense_gemv's, BLOCK_K / 16 a multiple of 32 x num_warps."""
    assert q.shape[0] == 1 and q.dtype == weight.dtype == torch.float8_e4m3fn and weight.shape[1] == q.shape[1]
    assert scale_a.numel() == 1, "one row: one activation scale"
    return _launch(q, weight, scale_a.float().reshape(1), scale_b.float().reshape(-1), bias, out_dtype, config)


def _launch(x, weight, scale_a, scale_b, bias, out_dtype, config, silu_mul=False):
    assert use_triton(x)
    vec = 16 // weight.element_size()
    block_n, block_k, warps = config or gemv_config(weight.shape[0], weight.element_size())
    assert block_k % (vec * 32 * warps) == 0, (block_k, warps)
    x = x.contiguous()
    weight = weight.contiguous()
    N, K = weight.shape
    assert not silu_mul or N % 2 == 0, N
    out = torch.empty(1, N // 2 if silu_mul else N, dtype=out_dtype, device=x.device)
    scaled = scale_a is not None
    _dense_gemv_kernel[(cdiv(N, block_n),)](
        x, weight, scale_a if scaled else out, scale_b if scaled else out, bias if bias is not None else out, out, N,
        K, HAS_BIAS=bias is not None, SCALED=scaled, ROW_SCALES=scaled and scale_b.numel() > 1, SILU_MUL=silu_mul,
        VEC=vec, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0, num_warps=warps)
    return out


@early_kernel
def _dense_gemv_kernel(x_ptr, w_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, N, K, HAS_BIAS: tl.constexpr,
                       SCALED: tl.constexpr, ROW_SCALES: tl.constexpr, SILU_MUL: tl.constexpr, VEC: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """out[0, n] for BLOCK_N rows n (clamped for the loads, masked at the store). EVEN_K: BLOCK_K | K. SCALED: times
    sa[0] and sb[0] (or sb[n], ROW_SCALES). SILU_MUL: rows are gate rows pid * BLOCK_N / 2 + j and their up rows
    N / 2 later; out[pid * BLOCK_N / 2 + j] = silu(gate) * up (dense_gemv)."""
    C: tl.constexpr = BLOCK_K // VEC
    pid_n = tl.program_id(0)
    if SILU_MUL:
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N) % HALF
        offs_n = pid_n * HALF + j  # the output column of each row's pair
        n_rows = (tl.minimum(offs_n, N // 2 - 1) + (tl.arange(0, BLOCK_N) // HALF) * (N // 2)).to(tl.int64)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    cc = tl.arange(0, C)
    kk = (VEC * cc)[:, None, None] + tl.arange(0, VEC)[None, None, :]  # [C, 1, VEC]: k of each element in the step
    w_ptrs = w_ptr + n_rows[None, :, None] * K + kk  # [C, BN, VEC]
    acc = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    n_steps = tl.cdiv(K, BLOCK_K)
    w = load_streamed(w_ptrs, kk < K, not EVEN_K)
    wait_for_producers(PDL)
    for kb in range(0, n_steps):
        k0 = kb * BLOCK_K
        k_next = tl.minimum(kb + 1, n_steps - 1) * BLOCK_K  # the last step reloads itself
        w_next = load_streamed(w_ptrs + k_next, k_next + kk < K, not EVEN_K)
        if EVEN_K:
            xs = tl.load(x_ptr + k0 + kk)
        else:
            xs = tl.load(x_ptr + k0 + kk, mask=k0 + kk < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * xs.to(tl.float32), axis=2)
        w = w_next
    out = tl.sum(acc, axis=0)
    if SCALED:
        out = out * tl.load(sa_ptr)
        if ROW_SCALES:
            out = out * tl.load(sb_ptr + n_rows)
        else:
            out = out * tl.load(sb_ptr)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_rows).to(tl.float32)
    out = out.to(out_ptr.dtype.element_ty)
    if SILU_MUL:  # silu_and_mul's math on the rounded gate / up pairs: [BLOCK_N] -> [2, HALF]
        pair = tl.reshape(out.to(tl.float32), (2, HALF))
        half = tl.arange(0, 2)[:, None]
        gate = tl.sum(tl.where(half == 0, pair, 0.0), axis=0)
        up = tl.sum(tl.where(half == 1, pair, 0.0), axis=0)
        cols = pid_n * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=cols < N // 2)
    else:
        tl.store(out_ptr + offs_n, out, mask=offs_n < N)
