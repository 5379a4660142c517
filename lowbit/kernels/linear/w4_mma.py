"""Weight-only 4-bit GEMM (INT4, NVFP4) for 1 <= M <= 16 x rows on tensor cores: mma.sync m16n8k16 with fp32
accumulation, the weights dequantized in registers (no shared memory). The M = 1 GEMV's structure
(lowbit.kernels.linear.w4_gemv), with the tensor core doing the multiply-add: up to 8 x rows cost about what one does
(the mma's N = 8 columns); rows 9-16 (X_TILES = 2) take a second mma on the same dequantized A registers.

Same weights as lowbit.kernels.linear.w4a16 (W4Weight, qweight int32 [N, KP/8], nibble s of word j = element 8j + s,
u = q + 8; INT4 scales fp32 [KP/group, N], groups a multiple of 128: one scale per 128-k block; NVFP4 e4m3
[KP/128, N, 8] and a global scale); no repacking.

Lane mapping (the mma's): a program owns BLOCK_N = 16 R weight rows; its C = 32 x num_warps lanes c = 32 w + 4 g + t
(warp w, mma group g, thread-in-group t) are dim 0 of every tensor, all other dims live in the lane's registers.
A K step of BLOCK_K = 128 U num_warps: warp w takes U 128-k blocks (split-K over warps, summed at the end), and
lane t of a quad takes the 32 k (4 words, one 16-byte load) kb + 32 t .. + 31 of weight rows 16 r + g and
16 r + g + 8. One word (k .. k + 7) feeds two mmas: pair p = nibbles (p, p + 4) of the word is one bf16x2 / f16x2
register (LOP3 with the magic 128.0 / 1024.0, one HFMA2 to q = u - 8 exactly); mma 1 takes pairs 0, 1 as A columns
(2t, 2t+1), (2t+8, 2t+9) of rows g, g + 8, mma 2 pairs 2, 3. B column n is x row n: lane (g, t) holds the pairs
(x[g, k + p], x[g, k + p + 4]) of the same k (0 for rows g >= M), so the permuted k order is the same on both sides.
D: lane (g, t) gets weight rows g (d0, d1) and g + 8 (d2, d3) for x rows 2t (d0, d2) and 2t + 1 (d1, d3); the
second tile's B holds x rows 8 + g, and its D x rows 8 + 2t, 9 + 2t.
The eight mmas of a 128-k block chain in the tensor core's fp32 accumulator, then acc += D (x the INT4 group scale).
INT4: x's dtype picks the mma type: bf16 -> bf16 mma (magic 128.0, a shift per pair), fp16 -> f16 (magic 1024.0:
the high nibbles dequantize from bits 4..7 as 1024 + 16 u, one shift per word). NVFP4: f16 mmas (x rounded to fp16,
as w4a16), each pair the e2m1 values x 2^-14 times the word's block scale (exact in fp16; a lane's 8 k lie in one
16-block, but the lanes of one mma cover four blocks, so the scale goes into A); global scale x 2^14 at the end.
INT4 zero points (W4A16_ZP, w = (q - z) s; zero_point int8 [KP/group, N], the scales' layout): the HFMA2 that
takes the magic off subtracts 136 + z (bf16) / 1032 + z and 72 + z (f16) instead, a register per row and block in
place of the constant: A holds q - z, an integer in [-15, 15], exact in both types (136 + z and 1032 + z are
exact too), so the products and the fp32 sums are as without zero points; no instruction per weight is added.
Under the interpreter (no PTX) the dequantization and the warp-wide mma are emulated with Triton ops.
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels._triton import cdiv, helper, interpreting, kernel, split2, split4, tl, use_triton, \
    wait_for_producers
from lowbit.kernels.linear.w4_gemv import fp4_pair_bits, smoothed

MAX_M = 16  # two tiles of the mma's N = 8 (rows 9-16 take a second mma per A fragment)


def choose_config(M: int, N: int) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps) for M x rows and N weight rows when the caller gives no config."""
    t = tuning.current()
    return t.w4_mma_wide_config if M > 8 and N >= t.w4_mma_wide_n else t.w4_mma_config


def supports(M: int, w) -> bool:
    """x rows and weights this kernel takes: 1 <= M <= MAX_M, NVFP4 or INT4 with groups a multiple of 128."""
    return 1 <= M <= MAX_M and (w.fmt == "nvfp4" or w.group % 128 == 0)


def w4_mma(x, w, bias=None, config=None, zero_point=None):
    """x [M, K] bf16/fp16, M <= MAX_M -> [M, N] in x's dtype; w a W4Weight that `supports` takes. zero_point: INT4
    only, int8 [KP/group, N] (w.zero_point) subtracted from the codes in A; None: q * s."""
    assert use_triton(x)
    M, K = x.shape
    assert supports(M, w) and x.dtype in (torch.bfloat16, torch.float16), (M, w.fmt, w.group, x.dtype)
    N, KP = w.out_features, w.qweight.shape[1] * 8
    block_n, block_k, warps = config or choose_config(M, N)
    assert block_n % 16 == 0 and block_k % (128 * warps) == 0, (block_n, block_k, warps)
    if zero_point is not None:
        assert w.fmt == "int4" and zero_point.dtype == torch.int8 and zero_point.shape == w.scales.shape
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    fp4 = w.fmt == "nvfp4"
    bf16 = x.dtype == torch.bfloat16 and not fp4  # NVFP4 runs f16 mmas (x rounded to fp16, as w4a16)
    _w4_mma_kernel[(cdiv(N, block_n),)](
        x, w.qweight, w.scales, zero_point if zero_point is not None else w.scales,
        w.smooth if w.smooth is not None else x, bias if bias is not None else x, out,
        M, N, K, KP, KP // 8, w.global_scale * (2.0**14 if fp4 else 1.0), 0x43004300 if bf16 else 0x64006400,
        IS_FP4=fp4, BF16=bf16, GROUP=w.group, HAS_ZP=zero_point is not None, HAS_SMOOTH=w.smooth is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, WARPS=warps, EVEN_K=KP % block_k == 0, MASK_X=K % block_k != 0,
        X_TILES=1 if M <= 8 else 2, EMULATE=interpreting(), num_warps=warps)
    return out


@helper
def _split8(t):
    """[..., 8] -> 8 tensors [...] (element s of the last axis)."""
    e, o = split2(t)  # s even / odd
    x0, x2, x4, x6 = split4(e)
    x1, x3, x5, x7 = split4(o)
    return x0, x1, x2, x3, x4, x5, x6, x7


@helper
def _pair(lo, hi):
    """Two 16-bit floats -> one uint32 register (lo in the low half, as the mma reads f16x2 / bf16x2)."""
    return lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@helper
def _unpair(r, BF16: tl.constexpr):
    """uint32 register -> its (low, high) 16-bit floats as fp32."""
    dt = tl.bfloat16 if BF16 else tl.float16
    lo = (r & 0xFFFF).to(tl.uint16).to(dt, bitcast=True).to(tl.float32)
    hi = (r >> 16).to(tl.uint16).to(dt, bitcast=True).to(tl.float32)
    return lo, hi


@helper
def _dequant(wd, magic, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """uint32 word -> 4 registers, pair p = (q of nibble p, q of nibble p + 4) as bf16x2 / f16x2, q = u - 8 exact."""
    if EMULATE:
        dt = tl.bfloat16 if BF16 else tl.float16
        p0 = _pair(((wd & 0xF).to(tl.float32) - 8).to(dt), (((wd >> 16) & 0xF).to(tl.float32) - 8).to(dt))
        p1 = _pair((((wd >> 4) & 0xF).to(tl.float32) - 8).to(dt), (((wd >> 20) & 0xF).to(tl.float32) - 8).to(dt))
        p2 = _pair((((wd >> 8) & 0xF).to(tl.float32) - 8).to(dt), (((wd >> 24) & 0xF).to(tl.float32) - 8).to(dt))
        p3 = _pair((((wd >> 12) & 0xF).to(tl.float32) - 8).to(dt), (((wd >> 28) & 0xF).to(tl.float32) - 8).to(dt))
    elif BF16:  # 128 + u (magic 0x4300 per half), minus 136
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """{ .reg .b32 t, one, off;
            mov.b32 one, 0x3f803f80; mov.b32 off, 0xc308c308;
            lop3.b32 t, $4, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $0, t, one, off;
            shr.u32 t, $4, 4; lop3.b32 t, t, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $1, t, one, off;
            shr.u32 t, $4, 8; lop3.b32 t, t, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $2, t, one, off;
            shr.u32 t, $4, 12; lop3.b32 t, t, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $3, t, one, off; }""",
            "=r,=r,=r,=r,r,r", [wd, magic], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True,
            pack=1)
    else:  # low nibbles 1024 + u (minus 1032), high nibbles from bits 4..7: 1024 + 16 u (x 1/16 minus 72)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """{ .reg .b32 t, h, one, off, s16, off16;
            mov.b32 one, 0x3c003c00; mov.b32 off, 0xe408e408; mov.b32 s16, 0x2c002c00; mov.b32 off16, 0xd480d480;
            lop3.b32 t, $4, 0x000f000f, $5, 0xea; fma.rn.f16x2 $0, t, one, off;
            lop3.b32 t, $4, 0x00f000f0, $5, 0xea; fma.rn.f16x2 $1, t, s16, off16;
            shr.u32 h, $4, 8;
            lop3.b32 t, h, 0x000f000f, $5, 0xea; fma.rn.f16x2 $2, t, one, off;
            lop3.b32 t, h, 0x00f000f0, $5, 0xea; fma.rn.f16x2 $3, t, s16, off16; }""",
            "=r,=r,=r,=r,r,r", [wd, magic], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True,
            pack=1)
    return p0, p1, p2, p3


@helper
def _zp_offsets(z, BF16: tl.constexpr):
    """Zero points z [C, R, U] (int8) -> the HFMA2 addends of _dequant_zp, uint32 registers: bf16 -(136 + z) in both
    halves (and again); f16 -(1032 + z) and -(72 + z) (exact: integers below 2^8 / 2^11)."""
    zf = z.to(tl.float32)
    if BF16:
        off = (-(136.0 + zf)).to(tl.bfloat16)
        return _pair(off, off), _pair(off, off)
    off = (-(1032.0 + zf)).to(tl.float16)
    off16 = (-(72.0 + zf)).to(tl.float16)
    return _pair(off, off), _pair(off16, off16)


@helper
def _dequant_zp(wd, magic, off, off16, z, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """_dequant with zero points: pair p = (q - z of nibble p, of nibble p + 4), z the row's in the block; off, off16
    from _zp_offsets (the emulation reads z)."""
    if EMULATE:
        dt = tl.bfloat16 if BF16 else tl.float16
        zf = z.to(tl.float32) + 8
        p0 = _pair(((wd & 0xF).to(tl.float32) - zf).to(dt), (((wd >> 16) & 0xF).to(tl.float32) - zf).to(dt))
        p1 = _pair((((wd >> 4) & 0xF).to(tl.float32) - zf).to(dt), (((wd >> 20) & 0xF).to(tl.float32) - zf).to(dt))
        p2 = _pair((((wd >> 8) & 0xF).to(tl.float32) - zf).to(dt), (((wd >> 24) & 0xF).to(tl.float32) - zf).to(dt))
        p3 = _pair((((wd >> 12) & 0xF).to(tl.float32) - zf).to(dt), (((wd >> 28) & 0xF).to(tl.float32) - zf).to(dt))
    elif BF16:  # 128 + u, minus 136 + z
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """{ .reg .b32 t, one;
            mov.b32 one, 0x3f803f80;
            lop3.b32 t, $4, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $0, t, one, $6;
            shr.u32 t, $4, 4; lop3.b32 t, t, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $1, t, one, $6;
            shr.u32 t, $4, 8; lop3.b32 t, t, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $2, t, one, $6;
            shr.u32 t, $4, 12; lop3.b32 t, t, 0x000f000f, $5, 0xea; fma.rn.bf16x2 $3, t, one, $6; }""",
            "=r,=r,=r,=r,r,r,r", [wd, magic, off], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True, pack=1)
    else:  # low nibbles 1024 + u minus 1032 + z; high nibbles (1024 + 16 u) / 16 minus 72 + z
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """{ .reg .b32 t, h, one, s16;
            mov.b32 one, 0x3c003c00; mov.b32 s16, 0x2c002c00;
            lop3.b32 t, $4, 0x000f000f, $5, 0xea; fma.rn.f16x2 $0, t, one, $6;
            lop3.b32 t, $4, 0x00f000f0, $5, 0xea; fma.rn.f16x2 $1, t, s16, $7;
            shr.u32 h, $4, 8;
            lop3.b32 t, h, 0x000f000f, $5, 0xea; fma.rn.f16x2 $2, t, one, $6;
            lop3.b32 t, h, 0x00f000f0, $5, 0xea; fma.rn.f16x2 $3, t, s16, $7; }""",
            "=r,=r,=r,=r,r,r,r,r", [wd, magic, off, off16], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True, pack=1)
    return p0, p1, p2, p3


@helper
def _fp4_dequant(wd, p: tl.constexpr, scale2, EMULATE: tl.constexpr):
    """uint32 word -> pair p = (nibble p, nibble p + 4) as f16x2, each the e2m1 value x 2^-14 (fp4_pair_bits) x the
    block scale (exact in fp16): one HMUL2 by scale2 (the block scale in both halves)."""
    t = fp4_pair_bits(wd, p)
    if EMULATE:
        lo, hi = _unpair(t, False)
        s, _ = _unpair(scale2, False)
        return _pair((lo * s).to(tl.float16), (hi * s).to(tl.float16))
    return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [t, scale2], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@helper
def _emulated_products(a_lo, a_hi, b_lo, b_hi):
    """The mma's D for one A row slot, emulated: [C, R, U] per lane -> (D[row g, col 2t], D[row g, col 2t + 1]), where
    D[g, n] = sum over the quad's lanes t' of a(lane g, t') . b(lane n, t') (column n of B lives in lanes g = n)."""
    C: tl.constexpr = a_lo.shape[0]
    R: tl.constexpr = a_lo.shape[1]
    U: tl.constexpr = a_lo.shape[2]
    W: tl.constexpr = C // 32
    shape = (W, 8, 4, R, U)  # (warp, g, t, R, U)
    al, ah = tl.reshape(a_lo, shape), tl.reshape(a_hi, shape)
    bl = tl.reshape(tl.broadcast_to(b_lo, a_lo.shape), shape)  # b [C, 1, U]: the same for every row block
    bh = tl.reshape(tl.broadcast_to(b_hi, a_lo.shape), shape)
    # [W, g, n, t', R, U] -> sum over t'
    d = tl.sum(al[:, :, None] * bl[:, None, :] + ah[:, :, None] * bh[:, None, :], axis=3)  # [W, 8 g, 8 n, R, U]
    d_even, d_odd = tl.split(tl.permute(tl.reshape(d, (W, 8, 4, 2, R, U)), (0, 1, 2, 4, 5, 3)))  # n = 2t, 2t + 1
    return tl.reshape(d_even, (C, R, U)), tl.reshape(d_odd, (C, R, U))


@helper
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """One m16n8k16 per element of [C, R, U] (one element index over a warp's 32 lanes is one mma). A registers:
    a0 row g k slots (2t, 2t+1), a1 row g+8 same slots, a2 row g slots (2t+8, 2t+9), a3 row g+8; B: b0 slots
    (2t, 2t+1), b1 (2t+8, 2t+9) of column g. D = C + A B in fp32: d0 / d1 row g, columns 2t / 2t+1; d2 / d3 row g+8."""
    if EMULATE:
        l0, h0 = _unpair(a0, BF16)
        l1, h1 = _unpair(a1, BF16)
        l2, h2 = _unpair(a2, BF16)
        l3, h3 = _unpair(a3, BF16)
        x0, y0 = _unpair(b0, BF16)
        x1, y1 = _unpair(b1, BF16)
        g_e, g_o = _emulated_products(l0, h0, x0, y0)
        g_e2, g_o2 = _emulated_products(l2, h2, x1, y1)
        g8_e, g8_o = _emulated_products(l1, h1, x0, y0)
        g8_e2, g8_o2 = _emulated_products(l3, h3, x1, y1)
        d0, d1, d2, d3 = c0 + (g_e + g_e2), c1 + (g_o + g_o2), c2 + (g8_e + g8_e2), c3 + (g8_o + g8_o2)
    elif BF16:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return d0, d1, d2, d3


@helper
def _x_pairs(x_ptr, smooth_ptr, kx, xrow, M, K, BF16: tl.constexpr, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr):
    """x row xrow [C] of one word per lane and block, kx [C, U, 8] -> the 4 B registers (x[k+p], x[k+p+4])
    [C, 1, U]; 0 for rows xrow >= M."""
    mask = (xrow < M)[:, None, None]
    if MASK_X:
        mask = mask & (kx < K)
    xs = tl.load(x_ptr + xrow[:, None, None] * K + kx, mask=mask, other=0.0)
    xs = smoothed(xs, smooth_ptr, kx, K, HAS_SMOOTH, MASK_X).to(tl.bfloat16 if BF16 else tl.float16)
    v0, v1, v2, v3, v4, v5, v6, v7 = _split8(xs)
    return (_pair(v0, v4)[:, None, :], _pair(v1, v5)[:, None, :], _pair(v2, v6)[:, None, :],
            _pair(v3, v7)[:, None, :])


@helper
def _load_step(w_ptrs0, w_ptrs8, s_ptrs0, s_ptrs8, z_ptrs0, z_ptrs8, kb, KP, N, IS_FP4: tl.constexpr,
               GROUP: tl.constexpr, HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr):
    """Words [C, R, U, 4] of rows g and g+8, their scales and zero points for the lanes' 32-k chunks kb [C, U] (0
    past KP): INT4 the group's [C, R, U] (fp32; zero points int8, HAS_ZP, else the scales again); NVFP4 the chunk's
    two 16-blocks [C, R, U, 2] (fp16; s_ptrs at row x 8)."""
    kw = (kb // 8)[:, None, :, None]
    if IS_FP4:  # scales [KP/128, N, 8]: tile kb // 128, blocks (kb % 128) / 16 and the next
        ks = ((kb // 128) * N * 8 + (kb % 128) // 16)[:, None, :, None] + tl.arange(0, 2)[None, None, None, :]
    else:
        ks = (kb // GROUP * N)[:, None, :]
    if EVEN_K:
        w0 = tl.load(w_ptrs0 + kw, cache_modifier=".cg")
        w8 = tl.load(w_ptrs8 + kw, cache_modifier=".cg")
        s0 = tl.load(s_ptrs0 + ks)
        s8 = tl.load(s_ptrs8 + ks)
        z0, z8 = s0, s8
        if HAS_ZP:
            z0 = tl.load(z_ptrs0 + ks)
            z8 = tl.load(z_ptrs8 + ks)
    else:
        inb = (kb < KP)[:, None, :]
        smask = inb[:, :, :, None] if IS_FP4 else inb
        w0 = tl.load(w_ptrs0 + kw, mask=inb[:, :, :, None], other=0, cache_modifier=".cg")
        w8 = tl.load(w_ptrs8 + kw, mask=inb[:, :, :, None], other=0, cache_modifier=".cg")
        s0 = tl.load(s_ptrs0 + ks, mask=smask, other=0.0)
        s8 = tl.load(s_ptrs8 + ks, mask=smask, other=0.0)
        z0, z8 = s0, s8
        if HAS_ZP:
            z0 = tl.load(z_ptrs0 + ks, mask=smask, other=0)
            z8 = tl.load(z_ptrs8 + ks, mask=smask, other=0)
    if IS_FP4:
        s0 = s0.to(tl.float16)
        s8 = s8.to(tl.float16)
    return w0.to(tl.uint32, bitcast=True), w8.to(tl.uint32, bitcast=True), s0, s8, z0, z8


@helper
def _a_regs(wd, magic, sc, zp, off, off16, q: tl.constexpr, IS_FP4: tl.constexpr, BF16: tl.constexpr,
            HAS_ZP: tl.constexpr, EMULATE: tl.constexpr):
    """Word q of a lane's chunk -> its 4 A registers (pairs 0-3). NVFP4: times the block scale of word q (sc [C, R,
    U, 2]: the chunk's two 16-blocks, words 0-1 and 2-3). INT4 zero points (HAS_ZP): zp and its _zp_offsets."""
    if IS_FP4:
        s_lo, s_hi = tl.split(sc)
        s16 = s_lo if q < 2 else s_hi
        scale2 = _pair(s16, s16)
        return (_fp4_dequant(wd, 0, scale2, EMULATE), _fp4_dequant(wd, 1, scale2, EMULATE),
                _fp4_dequant(wd, 2, scale2, EMULATE), _fp4_dequant(wd, 3, scale2, EMULATE))
    if HAS_ZP:
        return _dequant_zp(wd, magic, off, off16, zp, BF16, EMULATE)
    return _dequant(wd, magic, BF16, EMULATE)


@helper
def _block(w0, w8, s0, s8, z0, z8, x_ptr, smooth_ptr, kx, xrow, M, K, magic, IS_FP4: tl.constexpr,
           BF16: tl.constexpr, HAS_ZP: tl.constexpr, HAS_SMOOTH: tl.constexpr, MASK_X: tl.constexpr,
           X_TILES: tl.constexpr, EMULATE: tl.constexpr):
    """The chained mmas of every lane's 128-k block: w0, w8 [C, R, U, 4] words of rows g, g+8 and their scales, kx
    [C, U] the lane's first k. Returns D [C, R, U] = sum over the block of w x, fp32, scaled: d0 / d1 row g, x rows
    2t / 2t+1; d2 / d3 row g+8; with X_TILES = 2 also d4..d7, the same for x rows 8 + 2t / 8 + 2t+1 (the same A
    registers, a second B). INT4: the group scale multiplies D; NVFP4: the block scales are in A. z0, z8: INT4 zero
    points (HAS_ZP) [C, R, U], subtracted from the codes in A."""
    z = tl.zeros(w0.shape[:3], tl.float32)
    d0, d1, d2, d3, d4, d5, d6, d7 = z, z, z, z, z, z, z, z
    g0 = split4(w0)
    g8 = split4(w8)
    o0, o0h, o8, o8h = magic, magic, magic, magic  # the zero points' HFMA2 addends (HAS_ZP)
    if HAS_ZP:
        o0, o0h = _zp_offsets(z0, BF16)
        o8, o8h = _zp_offsets(z8, BF16)
    for q in tl.static_range(4):  # word q of the lane: k = kx + 8q .. + 7
        kq = kx[:, :, None] + 8 * q + tl.arange(0, 8)[None, None, :]
        b0, b1, b2, b3 = _x_pairs(x_ptr, smooth_ptr, kq, xrow, M, K, BF16, HAS_SMOOTH, MASK_X)
        e0, e1, e2, e3 = _a_regs(g0[q], magic, s0, z0, o0, o0h, q, IS_FP4, BF16, HAS_ZP, EMULATE)
        f0, f1, f2, f3 = _a_regs(g8[q], magic, s8, z8, o8, o8h, q, IS_FP4, BF16, HAS_ZP, EMULATE)
        d0, d1, d2, d3 = _mma(e0, f0, e1, f1, b0, b1, d0, d1, d2, d3, BF16, EMULATE)
        d0, d1, d2, d3 = _mma(e2, f2, e3, f3, b2, b3, d0, d1, d2, d3, BF16, EMULATE)
        if X_TILES == 2:
            c0, c1, c2, c3 = _x_pairs(x_ptr, smooth_ptr, kq, xrow + 8, M, K, BF16, HAS_SMOOTH, MASK_X)
            d4, d5, d6, d7 = _mma(e0, f0, e1, f1, c0, c1, d4, d5, d6, d7, BF16, EMULATE)
            d4, d5, d6, d7 = _mma(e2, f2, e3, f3, c2, c3, d4, d5, d6, d7, BF16, EMULATE)
    if not IS_FP4:
        d0, d1, d2, d3 = d0 * s0, d1 * s0, d2 * s8, d3 * s8
        d4, d5, d6, d7 = d4 * s0, d5 * s0, d6 * s8, d7 * s8
    return d0, d1, d2, d3, d4, d5, d6, d7


@kernel
def _w4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, smooth_ptr, bias_ptr, out_ptr, M, N, K, KP, w_stride, global_scale,
                   magic, IS_FP4: tl.constexpr, BF16: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                   HAS_SMOOTH: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARPS: tl.constexpr,
                   EVEN_K: tl.constexpr, MASK_X: tl.constexpr, X_TILES: tl.constexpr, EMULATE: tl.constexpr,
                   PDL: tl.constexpr):
    """out[m, n] for m < M (<= 8 X_TILES) and BLOCK_N rows n, all of K. EVEN_K: BLOCK_K | KP; MASK_X: K % BLOCK_K
    != 0 (x masked past K; the padded weights past K are q = 0). The first step's weights are loaded before the PDL
    wait."""
    C: tl.constexpr = 32 * WARPS  # lanes
    R: tl.constexpr = BLOCK_N // 16  # row blocks
    U: tl.constexpr = BLOCK_K // (128 * WARPS)  # 128-k blocks per warp and step
    mg = magic.to(tl.uint32, bitcast=True)  # 128.0 / 1024.0 per half: a register, so each LOP3 takes one immediate
    cc = tl.arange(0, C)
    g = (cc % 32) // 4
    t = cc % 4
    kl = 128 * U * (cc // 32)[:, None] + 128 * tl.arange(0, U)[None, :] + 32 * t[:, None]  # [C, U]: lane's first k
    n0 = tl.program_id(0) * BLOCK_N
    rows0 = n0 + 16 * tl.arange(0, R)[None, :] + g[:, None]  # [C, R]
    rows8 = rows0 + 8
    r0 = tl.minimum(rows0, N - 1).to(tl.int64)  # clamped: loads need no mask on N
    r8 = tl.minimum(rows8, N - 1).to(tl.int64)
    w4 = tl.arange(0, 4)[None, None, None, :]
    w_ptrs0 = w_ptr + r0[:, :, None, None] * w_stride + w4
    w_ptrs8 = w_ptr + r8[:, :, None, None] * w_stride + w4
    if IS_FP4:
        s_ptrs0 = s_ptr + r0[:, :, None, None] * 8
        s_ptrs8 = s_ptr + r8[:, :, None, None] * 8
    else:
        s_ptrs0 = s_ptr + r0[:, :, None]
        s_ptrs8 = s_ptr + r8[:, :, None]
    z_ptrs0 = z_ptr + r0[:, :, None]  # INT4 zero points (HAS_ZP), the scales' layout
    z_ptrs8 = z_ptr + r8[:, :, None]
    acc0e = tl.zeros((C, R, U), tl.float32)  # weight row g, x row 2t
    acc0o, acc8e, acc8o = acc0e, acc0e, acc0e  # row g, x row 2t+1; row g+8, x rows 2t / 2t+1
    bcc0e, bcc0o, bcc8e, bcc8o = acc0e, acc0e, acc0e, acc0e  # the same for x rows 8 + 2t, 8 + 2t+1 (X_TILES = 2)
    n_steps = tl.cdiv(KP, BLOCK_K)
    w0, w8, s0, s8, z0, z8 = _load_step(w_ptrs0, w_ptrs8, s_ptrs0, s_ptrs8, z_ptrs0, z_ptrs8, kl, KP, N, IS_FP4, GROUP,
                                        HAS_ZP, EVEN_K)
    wait_for_producers(PDL)
    for kb in range(0, n_steps):
        k0 = kb * BLOCK_K
        nxt = tl.minimum(kb + 1, n_steps - 1) * BLOCK_K  # the last step reloads itself
        w0n, w8n, s0n, s8n, z0n, z8n = _load_step(w_ptrs0, w_ptrs8, s_ptrs0, s_ptrs8, z_ptrs0, z_ptrs8, nxt + kl, KP,
                                                  N, IS_FP4, GROUP, HAS_ZP, EVEN_K)
        d0, d1, d2, d3, d4, d5, d6, d7 = _block(w0, w8, s0, s8, z0, z8, x_ptr, smooth_ptr, k0 + kl, g, M, K, mg,
                                                IS_FP4, BF16, HAS_ZP, HAS_SMOOTH, MASK_X, X_TILES, EMULATE)
        acc0e += d0
        acc0o += d1
        acc8e += d2
        acc8o += d3
        if X_TILES == 2:
            bcc0e += d4
            bcc0o += d5
            bcc8e += d6
            bcc8o += d7
        w0, w8, s0, s8, z0, z8 = w0n, w8n, s0n, s8n, z0n, z8n
    _store(acc0e, rows0, 2 * t, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
    _store(acc0o, rows0, 2 * t + 1, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
    _store(acc8e, rows8, 2 * t, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
    _store(acc8o, rows8, 2 * t + 1, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
    if X_TILES == 2:
        _store(bcc0e, rows0, 8 + 2 * t, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
        _store(bcc0o, rows0, 9 + 2 * t, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
        _store(bcc8e, rows8, 8 + 2 * t, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)
        _store(bcc8o, rows8, 9 + 2 * t, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS)


@helper
def _store(acc, rows, xrow, bias_ptr, out_ptr, M, N, global_scale, HAS_BIAS: tl.constexpr):
    """acc [C, R, U] summed over blocks and warps -> out[xrow, rows] (lanes of warp 0's layout; rows [C, R], xrow
    [C]); rows >= N and x rows >= M are not stored."""
    C: tl.constexpr = acc.shape[0]
    R: tl.constexpr = acc.shape[1]
    tot = tl.sum(tl.reshape(tl.sum(acc, axis=2), (C // 32, 32, R)), axis=0) * global_scale  # [32, R]
    rows = tl.max(tl.reshape(rows, (C // 32, 32, R)), axis=0)  # (every warp holds the same rows)
    m = tl.max(tl.reshape(xrow, (C // 32, 32)), axis=0)[:, None]  # [32, 1]
    if HAS_BIAS:
        tot += tl.load(bias_ptr + tl.minimum(rows, N - 1)).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * N + rows, tot.to(out_ptr.dtype.element_ty), mask=(rows < N) & (m < M))
