"""INT8 W8A8 (SmoothQuant) at 1-8 x rows (decode): y = (q @ W^T) * scale_a * scale_b (+ bias), as scaled_gemm_ref, on
CUDA cores with `dp4a` (four int8 products summed into an int32 per instruction: a quarter of an instruction per
weight, no conversion). q [M, K] and W [N, K] int8, K-contiguous; scale_a fp32 [] or [M, 1], scale_b fp32 [] or [N].

The one-row GEMV's structure (lowbit.kernels.linear.dense_gemv): each program owns BLOCK_N weight rows over all of K,
read as int32 words; a K step is C = BLOCK_K / 16 chunks of 16 bytes per row, chunk c on thread c mod (32 x num_warps),
which holds every row of its chunks (one 16-byte load per row and chunk, .cg) and the chunk of every x row (M_PAD
rows, the ones past M masked to 0). The next step's weights are loaded while this one is summed; the first before
the PDL wait. Sums are exact int32 (|q w| <= 127^2, so K up to ~133k), scaled in fp32 once. Under the interpreter
dp4a is emulated with shifts (bytes sign-extended) and int32 math.
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels._triton import (cdiv, early_kernel, helper, interpreting, load_streamed, next_pow2, split4, tl,
                                    use_triton, wait_for_producers)

MAX_M = 8  # one int32 accumulator per x row

def supports(q: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor) -> bool:
    """int8 q and w, 1 <= M <= MAX_M, K a multiple of 4 (rows of int32 words), scale_a one value or one per row."""
    M, K = q.shape
    return (q.dtype == w.dtype == torch.int8 and 1 <= M <= MAX_M and K % 4 == 0 and w.shape[1] == K
            and scale_a.numel() in (1, M))


def int8_gemv(q, w, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, config=None):
    """q [M, K] int8 (x ~= q * scale_a), w [N, K] int8 -> [M, N] out_dtype (scales and bias as the module says).
    config (BLOCK_N, BLOCK_K bytes, num_warps), default Tuning.int8_gemv_config; BLOCK_K a multiple of
    16 x 32 x num_warps."""
    assert use_triton(q) and supports(q, w, scale_a), (q.shape, q.dtype, w.shape, w.dtype, scale_a.shape)
    M, K = q.shape
    N = w.shape[0]
    block_n, block_k, warps = config or tuning.current().int8_gemv_config
    assert block_k % (16 * 32 * warps) == 0, (block_k, warps)
    sa, sb = scale_a.float().reshape(-1).contiguous(), scale_b.float().reshape(-1).contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=q.device)
    _int8_gemv_kernel[(cdiv(N, block_n),)](
        q.contiguous().view(torch.int32), w.contiguous().view(torch.int32), sa, sb,
        bias if bias is not None else out, out, M, N, K // 4, SA_PER_ROW=sa.numel() > 1, SB_PER_ROW=sb.numel() > 1,
        HAS_BIAS=bias is not None, M_PAD=next_pow2(M), BLOCK_N=block_n, BLOCK_KW=block_k // 4,
        EVEN_K=K % block_k == 0, EMULATE=interpreting(), num_warps=warps)
    return out


@helper
def _word_dot(a, b):
    """Emulated dp4a without its addend: the sum of the products of int32 words a and b's signed bytes."""
    out = ((a << 24) >> 24) * ((b << 24) >> 24)
    for j in tl.static_range(1, 4):
        out += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
    return out


@helper
def _dp4a_chunk(w, x, acc, EMULATE: tl.constexpr):
    """acc + the dot product of 16-byte chunks w and x ([..., 4] int32 words, the same shape) as int32."""
    w0, w1, w2, w3 = split4(w)
    x0, x1, x2, x3 = split4(x)
    if EMULATE:
        out = acc + _word_dot(w0, x0) + _word_dot(w1, x1) + _word_dot(w2, x2) + _word_dot(w3, x3)
    else:
        out = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $5, $9; dp4a.s32.s32 $0, $2, $6, $0; dp4a.s32.s32 $0, $3, $7, $0; "
            "dp4a.s32.s32 $0, $4, $8, $0;", "=r,r,r,r,r,r,r,r,r,r", [w0, w1, w2, w3, x0, x1, x2, x3, acc],
            dtype=tl.int32, is_pure=True, pack=1)
    return out


@helper
def _x_chunks(x_ptr, r: tl.constexpr, M, KW, k0, kk):
    """x row r's chunks of the step at word k0, [C, 1, 4] (0 for r >= M and past K; the row test as a bound, not a
    scalar mask, which the interpreter rejects)."""
    words_left = tl.where(r < M, KW - k0, 0)
    return tl.load(x_ptr + tl.minimum(r, M - 1).to(tl.int64) * KW + k0 + kk, mask=kk < words_left, other=0)


@helper
def _row_step(w, x_ptr, r: tl.constexpr, M, KW, k0, kk, acc, EMULATE: tl.constexpr):
    """acc [C, BN] + x row r's step against the weights w [C, BN, 4]."""
    return _dp4a_chunk(w, tl.broadcast_to(_x_chunks(x_ptr, r, M, KW, k0, kk), w.shape), acc, EMULATE)


@helper
def _store_row(acc, r: tl.constexpr, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N,
               SA_PER_ROW: tl.constexpr, SB_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """x row r's sums acc [C, BN], scaled (+ bias) -> out[r, offs_n] (rows past M and N not stored)."""
    out = tl.sum(acc, axis=0).to(tl.float32)  # [BN]
    out *= tl.load(sa_ptr + tl.minimum(r, M - 1)) if SA_PER_ROW else tl.load(sa_ptr)
    out *= tl.load(sb_ptr + n_rows) if SB_PER_ROW else tl.load(sb_ptr)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_rows).to(tl.float32)
    tl.store(out_ptr + r * N + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < tl.where(r < M, N, 0))


@early_kernel
def _int8_gemv_kernel(x_ptr, w_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, KW, SA_PER_ROW: tl.constexpr,
                      SB_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] for m < M (<= M_PAD <= 8) and BLOCK_N rows n (clamped for the loads, masked at the store), KW = K / 4
    words per row. EVEN_K: BLOCK_KW | KW. One int32 accumulator per x row, so each row's chunk is broadcast over the
    weight rows in registers."""
    C: tl.constexpr = BLOCK_KW // 4  # 16-byte chunks per row and step
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    kk = (4 * tl.arange(0, C))[:, None, None] + tl.arange(0, 4)[None, None, :]  # [C, 1, 4]: word of each element
    w_ptrs = w_ptr + n_rows[None, :, None] * KW + kk  # [C, BN, 4]
    acc0 = tl.zeros((C, BLOCK_N), dtype=tl.int32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    n_steps = tl.cdiv(KW, BLOCK_KW)
    w = load_streamed(w_ptrs, kk < KW, not EVEN_K)
    wait_for_producers(PDL)
    for kb in range(0, n_steps):
        k0 = kb * BLOCK_KW
        k_next = tl.minimum(kb + 1, n_steps - 1) * BLOCK_KW  # the last step reloads itself
        w_next = load_streamed(w_ptrs + k_next, k_next + kk < KW, not EVEN_K)
        acc0 = _row_step(w, x_ptr, 0, M, KW, k0, kk, acc0, EMULATE)
        if M_PAD > 1:
            acc1 = _row_step(w, x_ptr, 1, M, KW, k0, kk, acc1, EMULATE)
        if M_PAD > 2:
            acc2 = _row_step(w, x_ptr, 2, M, KW, k0, kk, acc2, EMULATE)
            acc3 = _row_step(w, x_ptr, 3, M, KW, k0, kk, acc3, EMULATE)
        if M_PAD > 4:
            acc4 = _row_step(w, x_ptr, 4, M, KW, k0, kk, acc4, EMULATE)
            acc5 = _row_step(w, x_ptr, 5, M, KW, k0, kk, acc5, EMULATE)
            acc6 = _row_step(w, x_ptr, 6, M, KW, k0, kk, acc6, EMULATE)
            acc7 = _row_step(w, x_ptr, 7, M, KW, k0, kk, acc7, EMULATE)
        w = w_next
    _store_row(acc0, 0, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
    if M_PAD > 1:
        _store_row(acc1, 1, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
    if M_PAD > 2:
        _store_row(acc2, 2, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
        _store_row(acc3, 3, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
    if M_PAD > 4:
        _store_row(acc4, 4, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
        _store_row(acc5, 5, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
        _store_row(acc6, 6, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
        _store_row(acc7, 7, offs_n, n_rows, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
