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

"wide" kernel (M = 1 only; selected by GEMV_VARIANT or an explicit ("wide", ...) config), same layout:
- A K step is C = BLOCK_K / 32 chunks of 4 words (32 k) per row; chunk c goes to thread c (C = 32 x num_warps, or a
  multiple: several chunks per thread), and every thread holds all BLOCK_N rows of its chunks: one 16-byte weight
  load per row and chunk (.cg: L2 only), 4 x 16-byte x loads per chunk shared by the rows, INT4 scales as 16-byte
  loads of 4 rows (one group per chunk; two per chunk for groups of 16 and NVFP4 blocks). The dims are ordered so
  that Triton 3.6's coalescer gives words, x, scales and accumulator one register layout: no convert_layout, no
  shared memory in the loop (v1 on Triton 3.6 shuffles x through shared memory every step: 44 LDS + 18 BAR).
- INT4: one shift per two nibbles: nibbles 2j, 2j+1 of (word << 15 - 8j) sit at bits 15..18 and 19..22, OR'd into
  the mantissa of 256.0 / 16.0 (one LOP3 each: the OR constant is a kernel argument, so it lives in a register):
  v = 256 + u or 16 + u, exact. Per chunk and row one fp32 FMA chain over the 32 products starts at
  -sum(264 x_even + 24 x_odd) (computed once per chunk for all rows) and is scaled once. fp32 throughout; the
  chain carries the 256 x / 16 x terms, so its rounding error is ~2^-24 x 1000 |x| per FMA: ~1e-5 relative to
  the exact result (v1 ~7e-7, torch fp32 matmul ~6e-7; bf16 output rounding ~1e-3).
- NVFP4: nibbles s and s + 4 -> two fp16 halves of one word (mask of the code bits + merge of the sign bits), as
  in v1 = value * 2^-14 exactly; converted by inline PTX cvt.f32.f16 on the GPU (Triton's own conversion adds a
  PRMT per pair), by Triton in the interpreter (which cannot run PTX). Exact products, fp32 chain per 16-block.
- All of a step's loads are forced to issue before its compute: ptxas otherwise spreads them over the loop body
  (fewer live registers, the memory latency paid several times per step); see _all_loaded.
- Offline SASS (triton 3.6, sm_90, loop body per weight, M = 1): INT4 3.16 instructions (v1 7.75), NVFP4 4.73
  (v1 10.3); 128 registers at 8 rows.
"""
import torch

from lowbit.kernels._triton import cdiv, helper, interpreting, kernel, tl, use_triton

GEMV_VARIANT = "v1"  # the M = 1 kernel: "v1" (_w4_gemv_kernel) or "wide" (_w4_gemv_wide_kernel); M > 1 is always v1
WIDE_WEIGHT_CACHE = ".cg"  # the wide kernel's weight loads: ".cg" (L2 only: streamed once, L1 keeps x) or ""
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


def choose_gemv_config(M: int, N: int, KP: int, fmt: str, variant: str | None = None):
    """v1: (BLOCK_N, BLOCK_K, num_warps, PREFETCH). (4, 2048, 4, no prefetch) was within 3% of the best of 30 configs
    at M = 1 on every Llama-3.1-8B shape and both formats (H200 sweep, docs/kernels_notes.md "W4 decode GEMV").
    wide (M = 1 only): ("wide", BLOCK_N, BLOCK_K, num_warps, PREFETCH), see choose_wide_config."""
    if (variant or GEMV_VARIANT) == "wide" and M == 1:
        return choose_wide_config(N, KP, fmt)
    return 4, 2048, 4, False


def choose_wide_config(N: int, KP: int, fmt: str):
    """Not yet tuned on the GPU (bench/w4_gemv_bench.py prints the best per shape): 8 rows per program, 2 warps,
    BLOCK_K = 2048 (divides every KP of Llama-3.1-8B: no masked step; 128 registers: 8 programs per SM)."""
    return "wide", 8, 2048, 2, False


def w4_gemv(x, w, bias=None, config=None):
    """x [M, K] bf16/fp16 (M <= 8) -> [M, N] in x's dtype, w a lowbit.kernels.w4a16.W4Weight.
    config = (BLOCK_N, BLOCK_K, num_warps, PREFETCH) for v1 (BLOCK_K is halved until it divides KP), or
    ("wide", BLOCK_N, BLOCK_K, num_warps, PREFETCH) for the wide kernel (M = 1; BLOCK_K a multiple of
    1024 * num_warps); None: choose_gemv_config (GEMV_VARIANT)."""
    assert use_triton(x)
    x = x.contiguous()
    M, K = x.shape
    N, KP = w.out_features, w.qweight.shape[1] * 8
    config = config or choose_gemv_config(M, N, KP, w.fmt)
    if config[0] == "wide":
        return _w4_gemv_wide(x, w, bias, *config[1:])
    block_n, block_k, warps, prefetch = config
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


def _w4_gemv_wide(x, w, bias, block_n, block_k, warps, prefetch, use_asm=None):
    """The wide kernel: x [1, K] -> [1, N]. use_asm None: inline PTX on the GPU, the pure-Triton path in the
    interpreter (which cannot run PTX)."""
    M, K = x.shape
    assert M == 1, "the wide GEMV takes M = 1"
    assert block_k % (1024 * warps) == 0, (block_k, warps)  # C = BLOCK_K / 32 chunks cover all threads
    assert block_n % 4 == 0, block_n  # INT4 scales of 4 rows per load
    N, KP = w.out_features, w.qweight.shape[1] * 8
    if w.fmt == "int4":
        assert w.group % 16 == 0, w.group  # one scale per 16-wide half chunk at least
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _w4_gemv_wide_kernel[(cdiv(N, block_n),)](
        x, w.qweight, w.scales, w.smooth if w.smooth is not None else x, bias if bias is not None else x, out,
        N, K, KP, KP // 8, w.global_scale * (2.0**14 if w.fmt == "nvfp4" else 1.0), 0x43800000,
        IS_FP4=w.fmt == "nvfp4", GROUP=w.group, HAS_SMOOTH=w.smooth is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=KP % block_k == 0, MASK_X=K % block_k != 0, PREFETCH=prefetch,
        USE_ASM=not interpreting() if use_asm is None else use_asm, W_CACHE=WIDE_WEIGHT_CACHE, num_warps=warps)
    return out


# ---- "wide" GEMV (M = 1): 16-byte weight loads, all threads along K, two nibbles per shift
@helper
def _split4(t):
    """[C, BN, 4] -> 4 tensors [C, BN] (element i of the last axis)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))  # a: i = 0, 2; b: i = 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@helper
def _x_word(x_ptr, smooth_ptr, k, K, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr):
    """The 8 x values of one word of every chunk ([C] each, fp32), k [C, 8] their indices."""
    if MASK_X:
        xs = tl.load(x_ptr + k, mask=k < K, other=0.0)
    else:
        xs = tl.load(x_ptr + k)
    if HAS_SMOOTH:  # x * pre_quant_scale rounded to x's dtype (as the reference)
        if MASK_X:
            sm = tl.load(smooth_ptr + k, mask=k < K, other=0.0)
        else:
            sm = tl.load(smooth_ptr + k)
        xs = (xs.to(tl.float32) * sm.to(xs.dtype).to(tl.float32)).to(xs.dtype)
    return _split8(tl.reshape(xs.to(tl.float32), (k.shape[0] * 8,)))


@helper
def _int4_word(wd, x0, x1, x2, x3, x4, x5, x6, x7, chain, e256, e16):
    """chain [C, BN] += sum_s v_s x_s, v_s = 256 + u_s (s even) or 16 + u_s (s odd): nibbles 2j, 2j+1 sit at bits
    15..18 and 19..22 of one shifted copy of the word (one shift per two nibbles), OR'd into the mantissa of
    256.0 / 16.0 (exact)."""
    a = wd << 15
    chain = ((a & 0x00078000) | e256).to(tl.float32, bitcast=True) * x0[:, None] + chain
    chain = ((a & 0x00780000) | e16).to(tl.float32, bitcast=True) * x1[:, None] + chain
    a = wd << 7
    chain = ((a & 0x00078000) | e256).to(tl.float32, bitcast=True) * x2[:, None] + chain
    chain = ((a & 0x00780000) | e16).to(tl.float32, bitcast=True) * x3[:, None] + chain
    a = wd >> 1
    chain = ((a & 0x00078000) | e256).to(tl.float32, bitcast=True) * x4[:, None] + chain
    chain = ((a & 0x00780000) | e16).to(tl.float32, bitcast=True) * x5[:, None] + chain
    a = wd >> 9
    chain = ((a & 0x00078000) | e256).to(tl.float32, bitcast=True) * x6[:, None] + chain
    chain = ((a & 0x00780000) | e16).to(tl.float32, bitcast=True) * x7[:, None] + chain
    return chain


@helper
def _int4_offset(x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_s (c_s + 8) x_s for the values c_s (256 / 16) that _int4_word adds to each nibble."""
    return 264.0 * ((x0 + x2) + (x4 + x6)) + 24.0 * ((x1 + x3) + (x5 + x7))


@helper
def _fp4_pair(wd, s: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibbles s and s + 4 (e2m1 codes) of each word -> two fp32 tensors = value * 2^-14: the code's (e1 e0 m) go
    to bits 9..11 and its sign to bit 15 of an fp16 (e = 0 gives the subnormals 0 and 2^-15 exactly), both halves
    built by one mask and one merge."""
    if 9 - 4 * s >= 0:
        mag = (wd << (9 - 4 * s)) & 0x0E000E00
    else:
        mag = (wd >> (4 * s - 9)) & 0x0E000E00
    if 12 - 4 * s > 0:
        sgn = wd << (12 - 4 * s)
    else:
        sgn = wd
    t = (sgn & 0x80008000) | mag
    if USE_ASM:  # cvt.f32.f16 straight from the two halves (in Triton, ptxas packs halves of two rows first: +1 PRMT)
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [t], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = t.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (t >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@helper
def _fp4_word(wd, x0, x1, x2, x3, x4, x5, x6, x7, chain, USE_ASM: tl.constexpr):
    v0, v4 = _fp4_pair(wd, 0, USE_ASM)
    chain = v0 * x0[:, None] + chain
    chain = v4 * x4[:, None] + chain
    v1, v5 = _fp4_pair(wd, 1, USE_ASM)
    chain = v1 * x1[:, None] + chain
    chain = v5 * x5[:, None] + chain
    v2, v6 = _fp4_pair(wd, 2, USE_ASM)
    chain = v2 * x2[:, None] + chain
    chain = v6 * x6[:, None] + chain
    v3, v7 = _fp4_pair(wd, 3, USE_ASM)
    chain = v3 * x3[:, None] + chain
    chain = v7 * x7[:, None] + chain
    return chain


@helper
def _wide_load(w_ptrs, s_ptr, k0, cc, n_rows, offs_n0, N, KP, IS_FP4: tl.constexpr, GROUP: tl.constexpr,
               EVEN_K: tl.constexpr, W_CACHE: tl.constexpr):
    """Step k0: words [C, BN, 4] (uint32) and scales: NVFP4 [C, BN, 2] e4m3 (blocks 2(c%4), +1 of the 128-tile),
    INT4 groups < 32 [C, BN, 2] (two groups per chunk), else [C, BN]."""
    kc = k0 + 32 * cc  # first k of each chunk [C]
    if EVEN_K:
        words = tl.load(w_ptrs + k0 // 8, cache_modifier=W_CACHE)
    else:
        words = tl.load(w_ptrs + k0 // 8, mask=(kc < KP)[:, None, None], other=0, cache_modifier=W_CACHE)
    if IS_FP4:
        b2 = tl.arange(0, 2)
        sp = s_ptr + ((kc // 128)[:, None, None] * N + n_rows[None, :, None]) * 8 + (2 * (cc % 4))[:, None, None] \
            + b2[None, None, :]
        if EVEN_K:
            sc = tl.load(sp)
        else:
            sc = tl.load(sp, mask=(kc < KP)[:, None, None], other=0.0)
    elif GROUP < 32:
        b2 = tl.arange(0, 2)
        sp = s_ptr + ((kc[:, None] + 16 * b2[None, :]) // GROUP)[:, None, :] * N + n_rows[None, :, None]
        if EVEN_K:
            sc = tl.load(sp)
        else:
            sc = tl.load(sp, mask=(kc < KP)[:, None, None], other=0.0)
    else:  # [C, BN/4, 4]: 4 rows per 16-byte load (rows not clamped: masked on N, vector loads when 16 | N)
        r4 = offs_n0 + 4 * tl.arange(0, n_rows.shape[0] // 4)[:, None] + tl.arange(0, 4)[None, :]
        sp = s_ptr + (kc // GROUP)[:, None, None] * N + r4[None, :, :]
        mask = (r4 < N)[None, :, :]
        if not EVEN_K:
            mask = mask & (kc < KP)[:, None, None]
        sc = tl.reshape(tl.load(sp, mask=mask, other=0.0), (kc.shape[0], n_rows.shape[0]))
    return words.to(tl.uint32, bitcast=True), sc


@helper
def _all_loaded(words, sc, zero, IS_FP4: tl.constexpr):
    """[C] uint32, = 0 at run time (zero is 0 but opaque to the compiler), that depends on every word and scale of
    the step: folded into the first dequantization, it makes ptxas issue all of the step's loads before the compute
    (left alone, it spreads them over the loop body to save registers, exposing the memory latency several times
    per step)."""
    d = tl.xor_sum(tl.xor_sum(words, axis=2), axis=1)
    if IS_FP4:
        sb = sc.to(tl.uint8, bitcast=True).to(tl.uint32)
    else:
        sb = sc.to(tl.uint32, bitcast=True)
    if len(sb.shape) == 3:
        sb = tl.xor_sum(sb, axis=2)
    return (d ^ tl.xor_sum(sb, axis=1)) & zero


@helper
def _wide_step(acc, words, sc, dep, zero, x_ptr, smooth_ptr, k0, cc, K, e256, e16, IS_FP4: tl.constexpr,
               TWO_SCALES: tl.constexpr, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr, USE_ASM: tl.constexpr):
    """acc [C, BN] += the step's 32 products per chunk and row, scaled once per chunk (or per half chunk: NVFP4
    blocks, INT4 groups of 16). INT4 chains start at -offset (the 256 / 16 added to the nibbles and the 8 of
    q = u - 8, summed over x once per chunk for all rows). dep [C] is 0 at run time (see _all_loaded)."""
    w0, w1, w2, w3 = _split4(words)
    kx = k0 + 32 * cc[:, None] + tl.arange(0, 8)[None, :]  # [C, 8]: x of word 0 of each chunk
    a0, a1, a2, a3, a4, a5, a6, a7 = _x_word(x_ptr, smooth_ptr, kx, K, HAS_SMOOTH, MASK_X)
    b0, b1, b2, b3, b4, b5, b6, b7 = _x_word(x_ptr, smooth_ptr, kx + 8, K, HAS_SMOOTH, MASK_X)
    c0, c1, c2, c3, c4, c5, c6, c7 = _x_word(x_ptr, smooth_ptr, kx + 16, K, HAS_SMOOTH, MASK_X)
    d0, d1, d2, d3, d4, d5, d6, d7 = _x_word(x_ptr, smooth_ptr, kx + 24, K, HAS_SMOOTH, MASK_X)
    if IS_FP4:  # INT4 reads all x first (the chain offsets); NVFP4 would wait for the last x loads mid-step
        xb = (a0.to(tl.uint32, bitcast=True) ^ b0.to(tl.uint32, bitcast=True)) ^ \
            (c0.to(tl.uint32, bitcast=True) ^ d0.to(tl.uint32, bitcast=True))
        dep = dep ^ (xb & zero)
    e256 = (e256 | dep)[:, None]
    e16 = (e16 | dep)[:, None]
    zero_f = tl.broadcast_to(dep.to(tl.float32, bitcast=True)[:, None], acc.shape)
    if TWO_SCALES:
        s0, s1 = tl.split(sc)
        s0 = s0.to(tl.float32)
        s1 = s1.to(tl.float32)
    if IS_FP4:
        chain = _fp4_word(w0, a0, a1, a2, a3, a4, a5, a6, a7, zero_f, USE_ASM)
        chain = _fp4_word(w1, b0, b1, b2, b3, b4, b5, b6, b7, chain, USE_ASM)
        acc += chain * s0
        chain = _fp4_word(w2, c0, c1, c2, c3, c4, c5, c6, c7, zero_f, USE_ASM)
        chain = _fp4_word(w3, d0, d1, d2, d3, d4, d5, d6, d7, chain, USE_ASM)
        acc += chain * s1
    else:
        off_ab = _int4_offset(a0, a1, a2, a3, a4, a5, a6, a7) + _int4_offset(b0, b1, b2, b3, b4, b5, b6, b7)
        off_cd = _int4_offset(c0, c1, c2, c3, c4, c5, c6, c7) + _int4_offset(d0, d1, d2, d3, d4, d5, d6, d7)
        if TWO_SCALES:
            chain = _int4_word(w0, a0, a1, a2, a3, a4, a5, a6, a7, tl.broadcast_to(-off_ab[:, None], acc.shape),
                               e256, e16)
            chain = _int4_word(w1, b0, b1, b2, b3, b4, b5, b6, b7, chain, e256, e16)
            acc += chain * s0
            chain = _int4_word(w2, c0, c1, c2, c3, c4, c5, c6, c7, tl.broadcast_to(-off_cd[:, None], acc.shape),
                               e256, e16)
        else:
            chain = _int4_word(w0, a0, a1, a2, a3, a4, a5, a6, a7,
                               tl.broadcast_to(-(off_ab + off_cd)[:, None], acc.shape), e256, e16)
            chain = _int4_word(w1, b0, b1, b2, b3, b4, b5, b6, b7, chain, e256, e16)
            chain = _int4_word(w2, c0, c1, c2, c3, c4, c5, c6, c7, chain, e256, e16)
        chain = _int4_word(w3, d0, d1, d2, d3, d4, d5, d6, d7, chain, e256, e16)
        if TWO_SCALES:
            acc += chain * s1
        else:
            acc += chain * sc.to(tl.float32)
    return acc


@kernel
def _w4_gemv_wide_kernel(x_ptr, w_ptr, s_ptr, smooth_ptr, bias_ptr, out_ptr, N, K, KP, w_stride, global_scale, magic,
                         IS_FP4: tl.constexpr, GROUP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, MASK_X: tl.constexpr, PREFETCH: tl.constexpr, USE_ASM: tl.constexpr,
                         W_CACHE: tl.constexpr):
    """out[0, n] for BLOCK_N rows n, all of K (M = 1). Chunk c of a K step = 4 words (32 k) of each row, one 16-byte
    load per row; the C = BLOCK_K / 32 chunks of a step lie along all threads (C = 32 x num_warps), so each thread
    holds all BLOCK_N rows of its chunk, and x, scales and words share one register layout."""
    C: tl.constexpr = BLOCK_K // 32
    # magic = 0x43800000 (256.0f) from the host: an opaque value lives in a register, so that each nibble's mask and
    # OR is one LOP3 (with two immediates ptxas emits two)
    e256 = magic.to(tl.uint32, bitcast=True)
    e16 = e256 - 0x02000000  # 16.0f
    zero = (magic >> 31).to(tl.uint32, bitcast=True)  # 0, opaque
    TWO_SCALES: tl.constexpr = IS_FP4 or GROUP < 32
    pid_n = tl.program_id(0)
    offs_n0 = pid_n * BLOCK_N
    offs_n = offs_n0 + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no mask on N, the store is masked
    cc = tl.arange(0, C)
    w_ptrs = w_ptr + n_rows[None, :, None] * w_stride + (4 * cc)[:, None, None] + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    n_steps = tl.cdiv(KP, BLOCK_K)
    if PREFETCH:
        words, sc = _wide_load(w_ptrs, s_ptr, 0, cc, n_rows, offs_n0, N, KP, IS_FP4, GROUP, EVEN_K, W_CACHE)
        for kb in range(0, n_steps):
            k0 = kb * BLOCK_K
            words_next, sc_next = _wide_load(w_ptrs, s_ptr, tl.minimum(kb + 1, n_steps - 1) * BLOCK_K, cc, n_rows,
                                             offs_n0, N, KP, IS_FP4, GROUP, EVEN_K, W_CACHE)
            acc = _wide_step(acc, words, sc, tl.zeros((C,), tl.uint32), 0, x_ptr, smooth_ptr, k0, cc, K, e256, e16,
                             IS_FP4, TWO_SCALES, HAS_SMOOTH, MASK_X, USE_ASM)
            words, sc = words_next, sc_next
    else:
        for kb in range(0, n_steps):
            k0 = kb * BLOCK_K
            words, sc = _wide_load(w_ptrs, s_ptr, k0, cc, n_rows, offs_n0, N, KP, IS_FP4, GROUP, EVEN_K, W_CACHE)
            acc = _wide_step(acc, words, sc, _all_loaded(words, sc, zero, IS_FP4), zero, x_ptr, smooth_ptr, k0, cc, K,
                             e256, e16, IS_FP4, TWO_SCALES, HAS_SMOOTH, MASK_X, USE_ASM)
    out = tl.sum(acc, axis=0) * global_scale
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_rows).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)

