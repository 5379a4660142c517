"""Decode (M = 1) weight-only 4-bit GEMV: CUDA-core dequantize + multiply + reduce over K, no tl.dot. It also takes
two x rows (M2), which share each dequantized weight: one more FMA per weight and row.

Same layout as lowbit.kernels.linear.w4a16 (W4Weight): qweight int32 [N, KP/8], nibble s of word j = element 8j+s;
INT4 scales fp32 [KP/group, N] (nibble u = q + 8); NVFP4 scales e4m3 [KP/128, N, 8] + a global scale.

Each program owns BLOCK_N output rows over all of K (no split-K, no second launch):
- A K step is C = BLOCK_K / 32 chunks of 4 words (32 k) per row; chunk c goes to thread c (C = 32 x num_warps, or a
  multiple: several chunks per thread), and every thread holds all BLOCK_N rows of its chunks: one 16-byte weight
  load per row and chunk (.cg: L2 only), 4 x 16-byte x loads per chunk shared by the rows, INT4 scales as 16-byte
  loads of 4 rows (one group per chunk; two per chunk for groups of 16 and NVFP4 blocks). The dims are ordered so
  that the coalescer gives words, x, scales and accumulator one register layout: no convert_layout, no shared
  memory in the loop.
- The next step's words and scales are loaded while this step is computed (the last step reloads itself).
- INT4: one shift per two nibbles: nibbles 2j, 2j+1 of (word << 15 - 8j) sit at bits 15..18 and 19..22, OR'd into
  the mantissa of 256.0 / 16.0 (one LOP3 each: the OR constant is a kernel argument, so it lives in a register):
  v = 256 + u or 16 + u, exact. Per chunk and row one fp32 FMA chain over the 32 products starts at
  -sum(264 x_even + 24 x_odd) (computed once per chunk for all rows) and is scaled once. The chain carries the
  256 x / 16 x terms: fp32 rounding ~1e-5 relative to the exact result (torch fp32 matmul ~6e-7; bf16 output ~1e-3).
- NVFP4: nibbles s and s + 4 -> two fp16 halves of one word (mask of the code bits + merge of the sign bits) = the
  e2m1 value * 2^-14 exactly (fp16 subnormals carry e = 0); converted by inline PTX cvt.f32.f16 on the GPU
  (Triton's own conversion adds a PRMT per pair), by Triton in the interpreter (which cannot run PTX). Exact
  products, fp32 chain per 16-block, times the e4m3 block scale; global scale and 2^14 applied once to the sum.
- Offline SASS (triton 3.6, sm_90, loop body per weight): INT4 3.16 instructions, NVFP4 4.73 at 8 rows (128
  registers), 5.08 at 4 rows (64: NVFP4's GEMV_CONFIG). Two rows (GEMV_CONFIG_M2): INT4 4.6 (168 registers), NVFP4
  6.5 (96), for twice the products.
- INT4 zero points (W4A16_ZP, w = (q - z) s; zero_point int8 [KP/group, N], loaded like the scales, 4 rows per
  32-bit load): the chain starts at -(offset + z sum(x chunk)) instead, so it sums (q - z) x with q - z an exact
  small integer, then is scaled once as without zero points: no correction launch. The z term is below the offset
  term in size (|z| <= 8 against 264 / 24), so the fp32 rounding bound above holds unchanged.
H200, Llama-3.1-8B shapes, per token: INT4 2.5x and NVFP4 2.0x cuBLAS bf16.
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels._triton import (cdiv, early_kernel, helper, interpreting, load_streamed, split4, tl,
                                    use_triton, wait_for_producers)

def w4_gemv(x, w, bias=None, config=None, zero_point=None):
    """x [M, K] bf16/fp16/fp32, M = 1 or 2 -> [M, N] in x's dtype, w a lowbit.kernels.linear.w4a16.W4Weight. Two
    rows share each dequantized weight (one more FMA per weight and row). config (BLOCK_N, BLOCK_K, num_warps),
    default Tuning.w4_gemv_config[w.fmt] (M = 1) or w4_gemv_config_m2; BLOCK_K a multiple of 1024 x num_warps.
    zero_point: INT4 only, int8 [KP/group, N] (w.zero_point) subtracted from the codes in the kernel; None: q * s."""
    assert use_triton(x)
    x = x.contiguous()
    M, K = x.shape
    assert M in (1, 2), "the GEMV takes M = 1 or 2"
    t = tuning.current()
    block_n, block_k, warps = config or (t.w4_gemv_config if M == 1 else t.w4_gemv_config_m2)[w.fmt]
    assert block_k % (1024 * warps) == 0, (block_k, warps)  # C = BLOCK_K / 32 chunks cover all threads
    assert block_n % 4 == 0, block_n  # INT4 scales of 4 rows per load
    if w.fmt == "int4":
        assert w.group % 16 == 0, w.group  # at most two scales per 32-wide chunk
    N, KP = w.out_features, w.qweight.shape[1] * 8
    if zero_point is not None:
        assert w.fmt == "int4" and zero_point.dtype == torch.int8 and zero_point.shape == w.scales.shape
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _w4_gemv_kernel[(cdiv(N, block_n),)](
        x, w.qweight, w.scales, zero_point if zero_point is not None else w.scales,
        w.smooth if w.smooth is not None else x, bias if bias is not None else x, out,
        N, K, KP, KP // 8, w.global_scale * (2.0**14 if w.fmt == "nvfp4" else 1.0), 0x43800000,
        IS_FP4=w.fmt == "nvfp4", GROUP=w.group, HAS_ZP=zero_point is not None, HAS_SMOOTH=w.smooth is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=KP % block_k == 0, MASK_X=K % block_k != 0,
        M2=M == 2, USE_ASM=not interpreting(), num_warps=warps)
    return out


@helper
def _split8(v):
    """[8C] -> 8 tensors [C]: element s of each group of 8 (the thread holding a group keeps its 8 values)."""
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
def smoothed(xs, smooth_ptr, k, K, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr):
    """xs (x at indices k, any shape) times pre_quant_scale[k] rounded to x's dtype, as the reference (HAS_SMOOTH);
    MASK_X: k may pass K."""
    if HAS_SMOOTH:
        if MASK_X:
            sm = tl.load(smooth_ptr + k, mask=k < K, other=0.0)
        else:
            sm = tl.load(smooth_ptr + k)
        xs = (xs.to(tl.float32) * sm.to(xs.dtype).to(tl.float32)).to(xs.dtype)
    return xs


@helper
def _x_word(x_ptr, smooth_ptr, k, K, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr):
    """The 8 x values of one word of every chunk ([C] each, fp32), k [C, 8] their indices (x = 0 past K)."""
    if MASK_X:
        xs = tl.load(x_ptr + k, mask=k < K, other=0.0)
    else:
        xs = tl.load(x_ptr + k)
    xs = smoothed(xs, smooth_ptr, k, K, HAS_SMOOTH, MASK_X)
    return _split8(tl.reshape(xs.to(tl.float32), (k.shape[0] * 8,)))


@helper
def _fma2(v, x, y, ca, cb, M2: tl.constexpr):
    """ca += v x and, for a second row (M2), cb += v y: one dequantized weight [C, BN] times x values [C]."""
    ca = v * x[:, None] + ca
    if M2:
        cb = v * y[:, None] + cb
    return ca, cb


@helper
def _int4_word(wd, x, y, ca, cb, e256, e16, M2: tl.constexpr):
    """ca [C, BN] += sum_s v_s x[s] (and cb with y, M2), v_s = 256 + u_s (s even) or 16 + u_s (s odd): nibbles 2j,
    2j+1 sit at bits 15..18 and 19..22 of one shifted copy of the word (one shift per two nibbles), OR'd into the
    mantissa of 256.0 / 16.0 (exact). x, y: the word's 8 x values of each row."""
    a = wd << 15
    ca, cb = _fma2(((a & 0x00078000) | e256).to(tl.float32, bitcast=True), x[0], y[0], ca, cb, M2)
    ca, cb = _fma2(((a & 0x00780000) | e16).to(tl.float32, bitcast=True), x[1], y[1], ca, cb, M2)
    a = wd << 7
    ca, cb = _fma2(((a & 0x00078000) | e256).to(tl.float32, bitcast=True), x[2], y[2], ca, cb, M2)
    ca, cb = _fma2(((a & 0x00780000) | e16).to(tl.float32, bitcast=True), x[3], y[3], ca, cb, M2)
    a = wd >> 1
    ca, cb = _fma2(((a & 0x00078000) | e256).to(tl.float32, bitcast=True), x[4], y[4], ca, cb, M2)
    ca, cb = _fma2(((a & 0x00780000) | e16).to(tl.float32, bitcast=True), x[5], y[5], ca, cb, M2)
    a = wd >> 9
    ca, cb = _fma2(((a & 0x00078000) | e256).to(tl.float32, bitcast=True), x[6], y[6], ca, cb, M2)
    ca, cb = _fma2(((a & 0x00780000) | e16).to(tl.float32, bitcast=True), x[7], y[7], ca, cb, M2)
    return ca, cb


@helper
def _int4_offset(x):
    """sum_s (c_s + 8) x[s] for the values c_s (256 / 16) that _int4_word adds to each nibble."""
    return 264.0 * ((x[0] + x[2]) + (x[4] + x[6])) + 24.0 * ((x[1] + x[3]) + (x[5] + x[7]))


@helper
def _x_sum(x):
    """sum_s x[s] over one word's 8 x values."""
    return ((x[0] + x[2]) + (x[4] + x[6])) + ((x[1] + x[3]) + (x[5] + x[7]))


@helper
def _chain_start(off, xsum, z, shape, HAS_ZP: tl.constexpr):
    """The INT4 chain's start [C, BN]: -off (off [C]: shared by the rows); with zero points z [C, BN] (fp32) also
    - z * xsum (xsum [C]: the chain's x values summed), so that the chain sums (q - z) x."""
    if HAS_ZP:
        return -(off[:, None] + z * xsum[:, None])
    return tl.broadcast_to(-off[:, None], shape)


@helper
def fp4_pair_bits(wd, s: tl.constexpr):
    """Nibbles s and s + 4 (e2m1 codes) of each uint32 word -> one uint32 holding two fp16 = value * 2^-14 (s in the
    low half): the code's (e1 e0 m) go to bits 9..11 and its sign to bit 15 (e = 0 gives the subnormals 0 and
    2^-15 exactly), both halves built by one mask and one merge."""
    if 9 - 4 * s >= 0:
        mag = (wd << (9 - 4 * s)) & 0x0E000E00
    else:
        mag = (wd >> (4 * s - 9)) & 0x0E000E00
    if 12 - 4 * s > 0:
        sgn = wd << (12 - 4 * s)
    else:
        sgn = wd
    return (sgn & 0x80008000) | mag


@helper
def _fp4_pair(wd, s: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibbles s and s + 4 (e2m1 codes) of each word -> two fp32 tensors = value * 2^-14 (fp4_pair_bits)."""
    t = fp4_pair_bits(wd, s)
    if USE_ASM:  # cvt.f32.f16 straight from the two halves (in Triton, ptxas packs halves of two rows first: +1 PRMT)
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [t], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = t.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (t >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@helper
def _fp4_word(wd, x, y, ca, cb, USE_ASM: tl.constexpr, M2: tl.constexpr):
    """ca [C, BN] += sum_s v_s x[s] (and cb with y, M2), v_s the e2m1 value of nibble s times 2^-14 (_fp4_pair)."""
    v0, v4 = _fp4_pair(wd, 0, USE_ASM)
    ca, cb = _fma2(v0, x[0], y[0], ca, cb, M2)
    ca, cb = _fma2(v4, x[4], y[4], ca, cb, M2)
    v1, v5 = _fp4_pair(wd, 1, USE_ASM)
    ca, cb = _fma2(v1, x[1], y[1], ca, cb, M2)
    ca, cb = _fma2(v5, x[5], y[5], ca, cb, M2)
    v2, v6 = _fp4_pair(wd, 2, USE_ASM)
    ca, cb = _fma2(v2, x[2], y[2], ca, cb, M2)
    ca, cb = _fma2(v6, x[6], y[6], ca, cb, M2)
    v3, v7 = _fp4_pair(wd, 3, USE_ASM)
    ca, cb = _fma2(v3, x[3], y[3], ca, cb, M2)
    ca, cb = _fma2(v7, x[7], y[7], ca, cb, M2)
    return ca, cb


@helper
def _load_step(w_ptrs, s_ptr, z_ptr, k0, cc, n_rows, offs_n0, N, KP, IS_FP4: tl.constexpr, GROUP: tl.constexpr,
               HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr):
    """Step k0: words [C, BN, 4] (uint32), scales and INT4 zero points (HAS_ZP; else the scales again): NVFP4 scales
    [C, BN, 2] e4m3 (blocks 2(c%4), +1 of the 128-tile), INT4 groups < 32 [C, BN, 2] (two groups per chunk), else
    [C, BN]. Chunks past KP load 0."""
    kc = k0 + 32 * cc  # first k of each chunk [C]
    words = load_streamed(w_ptrs + k0 // 8, (kc < KP)[:, None, None], not EVEN_K)
    if IS_FP4:
        b2 = tl.arange(0, 2)
        sp = s_ptr + ((kc // 128)[:, None, None] * N + n_rows[None, :, None]) * 8 + (2 * (cc % 4))[:, None, None] \
            + b2[None, None, :]
        if EVEN_K:
            sc = tl.load(sp)
        else:
            sc = tl.load(sp, mask=(kc < KP)[:, None, None], other=0.0)
        zp = sc
    else:
        sc = _group_values(s_ptr, kc, n_rows, offs_n0, N, KP, GROUP, EVEN_K)
        zp = sc
        if HAS_ZP:
            zp = _group_values(z_ptr, kc, n_rows, offs_n0, N, KP, GROUP, EVEN_K)
    return words.to(tl.uint32, bitcast=True), sc, zp


@helper
def _group_values(p, kc, n_rows, offs_n0, N, KP, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """INT4 per-group values [KP/group, N] (scales, zero points) of chunks starting at kc [C] and the rows: groups
    < 32 [C, BN, 2] (two groups per chunk), else [C, BN]. Chunks past KP load 0."""
    if GROUP < 32:
        b2 = tl.arange(0, 2)
        sp = p + ((kc[:, None] + 16 * b2[None, :]) // GROUP)[:, None, :] * N + n_rows[None, :, None]
        if EVEN_K:
            v = tl.load(sp)
        else:
            v = tl.load(sp, mask=(kc < KP)[:, None, None], other=0)
    else:  # [C, BN/4, 4]: 4 rows per vector load (rows not clamped: masked on N, vector loads when 16 | N)
        r4 = offs_n0 + 4 * tl.arange(0, n_rows.shape[0] // 4)[:, None] + tl.arange(0, 4)[None, :]
        sp = p + (kc // GROUP)[:, None, None] * N + r4[None, :, :]
        mask = (r4 < N)[None, :, :]
        if not EVEN_K:
            mask = mask & (kc < KP)[:, None, None]
        v = tl.reshape(tl.load(sp, mask=mask, other=0), (kc.shape[0], n_rows.shape[0]))
    return v


@helper
def _step(acc, acc2, words, sc, zp, x_ptr, smooth_ptr, k0, cc, K, e256, e16, IS_FP4: tl.constexpr,
          TWO_SCALES: tl.constexpr, HAS_ZP: tl.constexpr, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr,
          USE_ASM: tl.constexpr, M2: tl.constexpr):
    """acc [C, BN] += the step's 32 products per chunk and row, scaled once per chunk (or per half chunk: NVFP4
    blocks, INT4 groups of 16); acc2 the same for x's second row (M2: x [2, K]), from the same dequantized weights.
    INT4 chains start at -offset (the 256 / 16 added to the nibbles and the 8 of q = u - 8, summed over x once per
    chunk for all rows), minus z times the chain's x sum with zero points zp (HAS_ZP, int8 shaped as sc)."""
    w0, w1, w2, w3 = split4(words)
    kx = k0 + 32 * cc[:, None] + tl.arange(0, 8)[None, :]  # [C, 8]: x of word 0 of each chunk
    xa = _x_word(x_ptr, smooth_ptr, kx, K, HAS_SMOOTH, MASK_X)  # 8 tensors [C] each
    xb = _x_word(x_ptr, smooth_ptr, kx + 8, K, HAS_SMOOTH, MASK_X)
    xc = _x_word(x_ptr, smooth_ptr, kx + 16, K, HAS_SMOOTH, MASK_X)
    xd = _x_word(x_ptr, smooth_ptr, kx + 24, K, HAS_SMOOTH, MASK_X)
    if M2:
        ya = _x_word(x_ptr + K, smooth_ptr, kx, K, HAS_SMOOTH, MASK_X)
        yb = _x_word(x_ptr + K, smooth_ptr, kx + 8, K, HAS_SMOOTH, MASK_X)
        yc = _x_word(x_ptr + K, smooth_ptr, kx + 16, K, HAS_SMOOTH, MASK_X)
        yd = _x_word(x_ptr + K, smooth_ptr, kx + 24, K, HAS_SMOOTH, MASK_X)
    else:
        ya, yb, yc, yd = xa, xb, xc, xd
    if TWO_SCALES:
        s0, s1 = tl.split(sc)
        s0 = s0.to(tl.float32)
        s1 = s1.to(tl.float32)
    if IS_FP4:
        zero = tl.zeros(acc.shape, tl.float32)
        ca, cb = _fp4_word(w0, xa, ya, zero, zero, USE_ASM, M2)
        ca, cb = _fp4_word(w1, xb, yb, ca, cb, USE_ASM, M2)
        acc += ca * s0
        if M2:
            acc2 += cb * s0
        ca, cb = _fp4_word(w2, xc, yc, zero, zero, USE_ASM, M2)
        ca, cb = _fp4_word(w3, xd, yd, ca, cb, USE_ASM, M2)
        acc += ca * s1
        if M2:
            acc2 += cb * s1
    else:
        off_ab = _int4_offset(xa) + _int4_offset(xb)
        off_cd = _int4_offset(xc) + _int4_offset(xd)
        off2_ab = _int4_offset(ya) + _int4_offset(yb)
        off2_cd = _int4_offset(yc) + _int4_offset(yd)
        xs_ab, xs_cd, ys_ab, ys_cd = off_ab, off_cd, off2_ab, off2_cd  # x sums: read only with zero points
        if HAS_ZP:
            xs_ab, xs_cd = _x_sum(xa) + _x_sum(xb), _x_sum(xc) + _x_sum(xd)
            ys_ab, ys_cd = _x_sum(ya) + _x_sum(yb), _x_sum(yc) + _x_sum(yd)
        if TWO_SCALES:
            z0, z1 = s0, s1
            if HAS_ZP:
                z0, z1 = tl.split(zp)
                z0 = z0.to(tl.float32)
                z1 = z1.to(tl.float32)
            ca, cb = _int4_word(w0, xa, ya, _chain_start(off_ab, xs_ab, z0, acc.shape, HAS_ZP),
                                _chain_start(off2_ab, ys_ab, z0, acc.shape, HAS_ZP), e256, e16, M2)
            ca, cb = _int4_word(w1, xb, yb, ca, cb, e256, e16, M2)
            acc += ca * s0
            if M2:
                acc2 += cb * s0
            ca, cb = _int4_word(w2, xc, yc, _chain_start(off_cd, xs_cd, z1, acc.shape, HAS_ZP),
                                _chain_start(off2_cd, ys_cd, z1, acc.shape, HAS_ZP), e256, e16, M2)
        else:
            z = zp.to(tl.float32)
            ca, cb = _int4_word(w0, xa, ya, _chain_start(off_ab + off_cd, xs_ab + xs_cd, z, acc.shape, HAS_ZP),
                                _chain_start(off2_ab + off2_cd, ys_ab + ys_cd, z, acc.shape, HAS_ZP), e256, e16, M2)
            ca, cb = _int4_word(w1, xb, yb, ca, cb, e256, e16, M2)
            ca, cb = _int4_word(w2, xc, yc, ca, cb, e256, e16, M2)
        ca, cb = _int4_word(w3, xd, yd, ca, cb, e256, e16, M2)
        if TWO_SCALES:
            acc += ca * s1
            if M2:
                acc2 += cb * s1
        else:
            acc += ca * sc.to(tl.float32)
            if M2:
                acc2 += cb * sc.to(tl.float32)
    return acc, acc2


@early_kernel
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, smooth_ptr, bias_ptr, out_ptr, N, K, KP, w_stride, global_scale,
                    magic, IS_FP4: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                    HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MASK_X: tl.constexpr,
                    M2: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] for BLOCK_N rows n, all of K, m = 0 (and 1, M2). EVEN_K: BLOCK_K | KP (no masked chunk); MASK_X:
    K % BLOCK_K != 0 (x and pre_quant_scale masked past K; the padded weights past K are 0 anyway). The first step's
    weights are loaded before waiting for x's producer (PDL)."""
    C: tl.constexpr = BLOCK_K // 32
    # magic = 0x43800000 (256.0f) from the host: an opaque value lives in a register, so that each nibble's mask and
    # OR is one LOP3 (with two immediates ptxas emits two)
    e256 = magic.to(tl.uint32, bitcast=True)
    e16 = e256 - 0x02000000  # 16.0f
    TWO_SCALES: tl.constexpr = IS_FP4 or GROUP < 32
    pid_n = tl.program_id(0)
    offs_n0 = pid_n * BLOCK_N
    offs_n = offs_n0 + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no mask on N, the store is masked
    cc = tl.arange(0, C)
    w_ptrs = w_ptr + n_rows[None, :, None] * w_stride + (4 * cc)[:, None, None] + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    acc2 = acc  # the second x row's sums (M2)
    n_steps = tl.cdiv(KP, BLOCK_K)
    words, sc, zp = _load_step(w_ptrs, s_ptr, z_ptr, 0, cc, n_rows, offs_n0, N, KP, IS_FP4, GROUP, HAS_ZP, EVEN_K)
    wait_for_producers(PDL)
    for kb in range(0, n_steps):
        k0 = kb * BLOCK_K  # (a multiple of BLOCK_K the compiler can see: aligned 16-byte x loads)
        words_next, sc_next, zp_next = _load_step(w_ptrs, s_ptr, z_ptr, tl.minimum(kb + 1, n_steps - 1) * BLOCK_K,
                                                  cc, n_rows, offs_n0, N, KP, IS_FP4, GROUP, HAS_ZP, EVEN_K)
        acc, acc2 = _step(acc, acc2, words, sc, zp, x_ptr, smooth_ptr, k0, cc, K, e256, e16, IS_FP4, TWO_SCALES,
                          HAS_ZP, HAS_SMOOTH, MASK_X, USE_ASM, M2)
        words, sc, zp = words_next, sc_next, zp_next
    out = tl.sum(acc, axis=0) * global_scale
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n_rows).to(tl.float32)
        out += bias
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
    if M2:
        out2 = tl.sum(acc2, axis=0) * global_scale
        if HAS_BIAS:
            out2 += bias
        tl.store(out_ptr + N + offs_n, out2.to(out_ptr.dtype.element_ty), mask=offs_n < N)
