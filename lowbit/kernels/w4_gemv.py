"""Decode (small M) weight-only 4-bit GEMV: CUDA-core dequantize + multiply + reduce over K, no tl.dot.

Same kernel layout as lowbit.kernels.w4a16 (W4Weight): qweight int32 [N, KP/8], nibble s of word j = element 8j+s;
INT4 scales fp32 [KP/group, N] (nibble = q + 8); NVFP4 scales e4m3 [KP/128, N, 8] + a global scale.

Each program owns BLOCK_N output rows over all of K (no split-K, no second launch) and all M (<= 8) rows of x, one
fp32 accumulator [BLOCK_N, BLOCK_K/8] per x row. Per K step each thread loads one int32 word per weight row and the
8 contiguous x values of that word (one 16-byte load, split into 8 per-nibble tensors), so weights and x share one
register layout and nothing goes through shared memory. A word never straddles a scale group (INT4 groups and NVFP4
blocks are >= 16 wide), so the 8 products of a word are summed first and scaled once.

Dequantization, fp32, exact (the compiler turns the constant rotates into one shift + one LOP3 per nibble):
- INT4: nibble u moved to bits 19..22 of 0x3F800000 is the float 1 + u/16; sum_s (1 + u_s/16) x_s * 16 scale -
  24 scale * sum_s x_s = sum_s q_s scale x_s.
- NVFP4: code bits (e1 e0 m) moved to bits 9..11 and the sign to bit 15 of an fp16 are the e2m1 value * 2^-14
  (fp16 subnormals carry e = 0 exactly); converted to fp32, times the e4m3 block scale; the global scale and 2^14
  are applied once to the sum.
"""
import torch

from lowbit.kernels._triton import cdiv, helper, kernel, tl, use_triton

GEMV_MAX_M = 1  # w4a16_gemm dispatches M <= this to the GEMV: at M = 2 the tensor-core kernel is already as fast
# or faster on every Llama shape (H200 sweep, docs/kernels_notes.md); the kernel itself takes M <= 8


@helper
def _rotl(v, r: tl.constexpr):
    """uint32 rotate left by a constant 1..31 (the compiler keeps only the shift the masked bits need)."""
    return (v << r) | (v >> (32 - r))


@helper
def _val(words, s: tl.constexpr, IS_FP4: tl.constexpr):
    """Nibble s of every word -> fp32: 1 + u/16 (INT4, u = q + 8) or the e2m1 value * 2^-14 (NVFP4)."""
    if IS_FP4:
        lo = _rotl(words, (9 - 4 * s + 32) % 32)  # code bits 0..3 at bits 9..12
        bits = (lo & 0x0E00) | ((lo << 3) & 0x8000)  # sign (code bit 3) to bit 15
        v = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = _rotl(words, (19 - 4 * s + 32) % 32)  # nibble at bits 19..22: the top of an fp32 mantissa
        v = ((lo & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
    return v


@helper
def _split8(v):
    """[BK] -> 8 tensors [BK/8]: element s of each word (the thread holding a word keeps its 8 values)."""
    t = tl.reshape(v, (v.shape[0] // 8, 2, 2, 2))
    a0, a1 = tl.split(tl.permute(t, (0, 2, 3, 1)))  # bit 2 of s
    b0, b1 = tl.split(tl.permute(a0, (0, 2, 1)))  # bit 1
    b2, b3 = tl.split(tl.permute(a1, (0, 2, 1)))
    x0, x1 = tl.split(b0)  # bit 0
    x2, x3 = tl.split(b1)
    x4, x5 = tl.split(b2)
    x6, x7 = tl.split(b3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@helper
def _row_fma(acc, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, m: tl.constexpr, K,
             HAS_SMOOTH: tl.constexpr, IS_FP4: tl.constexpr):
    """acc [BN, W] (x row m) += per word: scale * sum_s value_s * x[m, 8j+s] (x masked past K; pre_quant_scale
    rounded to x's dtype first). One scale covers a word (INT4 groups and NVFP4 blocks are >= 16 wide)."""
    xs = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0)
    if HAS_SMOOTH:
        xs = (xs.to(tl.float32) * sm).to(xs.dtype)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xs.to(tl.float32))
    p = v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
    p += v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
    if IS_FP4:
        acc += p * sc
    else:  # sum (1 + u/16) x * 16 scale - 24 scale * sum x = sum (u - 8) scale x
        xsum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        acc += p * sc - sc2 * xsum[None, :]
    return acc


@helper
def _load_step(w_ptrs, s_ptr, k0, jw, n_rows, N, BLOCK_K: tl.constexpr, IS_FP4: tl.constexpr, GROUP: tl.constexpr):
    """Words [BN, W] (uint32) of K step k0 and the scale of each word (fp32)."""
    words = tl.load(w_ptrs + k0 // 8).to(tl.uint32, bitcast=True)
    kw = k0 + 8 * jw
    if IS_FP4:  # block scale of word j: tile kw // 128, block (kw % 128) // 16
        sc = tl.load(s_ptr + ((kw // 128)[None, :] * N + n_rows[:, None]) * 8 + ((kw % 128) // 16)[None, :])
    else:
        sc = tl.load(s_ptr + (kw // GROUP)[None, :] * N + n_rows[:, None])
    return words, sc.to(tl.float32)


@helper
def _store_row(acc, out_ptr, bias, m: tl.constexpr, M, N, offs_n, global_scale, HAS_BIAS: tl.constexpr):
    out = tl.sum(acc, axis=1) * global_scale
    if HAS_BIAS:
        out += bias
    tl.store(out_ptr + m * N + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)  # m < M = BLOCK_M


@kernel
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, smooth_ptr, bias_ptr, out_ptr, M, N, K, KP, w_stride, global_scale,
                    IS_FP4: tl.constexpr, GROUP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """out[m, n] for all m < M (BLOCK_M = M <= 8: one accumulator per row) and BLOCK_N rows n, all of K."""
    W: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no mask, the stores are masked
    # (2j)//2 hides the words' contiguity from the compiler, so that each thread loads one word per row, whose 8
    # elements line up with the 8 contiguous x values (one 16-byte load) the same thread holds: no layout shuffle.
    jw = (2 * tl.arange(0, W)) // 2
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n_rows[:, None] * w_stride + jw[None, :]  # [BN, W]
    acc0 = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    n_steps = KP // BLOCK_K
    words, sc = _load_step(w_ptrs, s_ptr, 0, jw, n_rows, N, BLOCK_K, IS_FP4, GROUP)
    for kb in range(0, n_steps):
        k0 = kb * BLOCK_K  # (a multiple of BLOCK_K the compiler can see: aligned 16-byte x loads)
        if PREFETCH:  # next step's words in flight while this one is computed (the last step reloads itself)
            words_next, sc_next = _load_step(w_ptrs, s_ptr, tl.minimum(kb + 1, n_steps - 1) * BLOCK_K, jw, n_rows,
                                             N, BLOCK_K, IS_FP4, GROUP)
        else:
            words, sc = _load_step(w_ptrs, s_ptr, k0, jw, n_rows, N, BLOCK_K, IS_FP4, GROUP)
            words_next, sc_next = words, sc
        if IS_FP4:
            sc2 = sc
        else:
            sc2 = 24.0 * sc
            sc = 16.0 * sc
        v0 = _val(words, 0, IS_FP4)
        v1 = _val(words, 1, IS_FP4)
        v2 = _val(words, 2, IS_FP4)
        v3 = _val(words, 3, IS_FP4)
        v4 = _val(words, 4, IS_FP4)
        v5 = _val(words, 5, IS_FP4)
        v6 = _val(words, 6, IS_FP4)
        v7 = _val(words, 7, IS_FP4)
        k = k0 + kk
        sm = k0  # unused without smooth
        if HAS_SMOOTH:
            sm = tl.load(smooth_ptr + k, mask=k < K, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc0 = _row_fma(acc0, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 0, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 1:
            acc1 = _row_fma(acc1, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 1, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 2:
            acc2 = _row_fma(acc2, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 2, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 3:
            acc3 = _row_fma(acc3, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 3, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 4:
            acc4 = _row_fma(acc4, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 4, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 5:
            acc5 = _row_fma(acc5, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 5, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 6:
            acc6 = _row_fma(acc6, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 6, K, HAS_SMOOTH, IS_FP4)
        if BLOCK_M > 7:
            acc7 = _row_fma(acc7, v0, v1, v2, v3, v4, v5, v6, v7, sc, sc2, x_ptr, sm, k, 7, K, HAS_SMOOTH, IS_FP4)
        words, sc = words_next, sc_next
    bias = global_scale  # unused without bias
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n_rows).to(tl.float32)
    _store_row(acc0, out_ptr, bias, 0, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 1:
        _store_row(acc1, out_ptr, bias, 1, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 2:
        _store_row(acc2, out_ptr, bias, 2, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 3:
        _store_row(acc3, out_ptr, bias, 3, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 4:
        _store_row(acc4, out_ptr, bias, 4, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 5:
        _store_row(acc5, out_ptr, bias, 5, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 6:
        _store_row(acc6, out_ptr, bias, 6, M, N, offs_n, global_scale, HAS_BIAS)
    if BLOCK_M > 7:
        _store_row(acc7, out_ptr, bias, 7, M, N, offs_n, global_scale, HAS_BIAS)


def choose_gemv_config(M: int, N: int, KP: int, fmt: str):
    """(BLOCK_N, BLOCK_K, num_warps, PREFETCH). (4, 2048, 4, no prefetch) was within 3% of the best of 30 configs
    at M = 1 on every Llama-3.1-8B shape and both formats (H200 sweep, docs/kernels_notes.md "W4 decode GEMV")."""
    return 4, 2048, 4, False


def w4_gemv(x, w, bias=None, config=None):
    """x [M, K] bf16/fp16 (M <= 8) -> [M, N] in x's dtype, w a lowbit.kernels.w4a16.W4Weight.
    config = (BLOCK_N, BLOCK_K, num_warps, PREFETCH); BLOCK_K is halved until it divides KP."""
    assert use_triton(x)
    x = x.contiguous()
    M, K = x.shape
    N, KP = w.out_features, w.qweight.shape[1] * 8
    block_n, block_k, warps, prefetch = config or choose_gemv_config(M, N, KP, w.fmt)
    while KP % block_k:  # KP is a multiple of 128
        block_k //= 2
    if w.fmt == "int4":
        assert w.group % 8 == 0, w.group  # a word (8 elements) must not straddle two scale groups
    assert 1 <= M <= 8, M
    block_m = M
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _w4_gemv_kernel[(cdiv(N, block_n),)](
        x, w.qweight, w.scales, w.smooth if w.smooth is not None else x, bias if bias is not None else x, out,
        M, N, K, KP, KP // 8, w.global_scale * (2.0**14 if w.fmt == "nvfp4" else 1.0),
        IS_FP4=w.fmt == "nvfp4", GROUP=w.group, HAS_SMOOTH=w.smooth is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch,
        num_warps=warps)
    return out
