"""Weight-only 4-bit GEMM: INT4 (modelopt W4A16_AWQ) and NVFP4 (e2m1 + e4m3 block-16 scales) weights, 16-bit x.

Kernel layout (built once at load by pack_int4 / pack_nvfp4; the on-disk layout stays modelopt's):
- qweight int32 [N, KP/8], KP = K rounded up to PACK_K = 128 (padding holds zeros); nibble s of word j holds
  element k = 8*j + s (natural order). The kernel reads a tile's 16 words per row as 64 bytes and dequantizes each
  byte's two nibbles (_byte_nibbles), so Triton loads the bytes straight into the registers of the dot's A operand.
  Two words are one NVFP4 block of 16.
- INT4: nibble = q + 8 (q in [-8, 7]); scales fp32 [KP/group, N] (transposed: one contiguous row per group).
  With zero points (W4A16_ZP, w = (q - z) * s): the same codes and scales, plus z int8 [KP/group, N] (the scales'
  layout; padding 0), which the GEMV and w4_mma subtract from the codes themselves, and zs = s * z fp32
  [K/group, N] for the other kernels, which compute q * s and are corrected by lowbit.kernels.linear.w4_zero_point.
- NVFP4: nibble = e2m1 code; scales float8_e4m3fn [KP/128, N, 8] (a row's 8 block scales of a tile are 8 contiguous
  bytes); global_scale = weight_scale_2 as a Python float.
The kernel computes out^T tiles (acc [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T) so that small M sits in the MMA's
N dimension; it splits K across programs when there are too few N blocks to fill the GPU (decode).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowbit.formats import NVFP4_BLOCK, nvfp4_dequantize, unpack_e2m1, unpack_int4_rows
from lowbit.kernels import routes, tuning
from lowbit.kernels.linear import split_k, w4_dequant, w4_gemv, w4_mma, w4_small_m, w4_zero_point
from lowbit.kernels._triton import cdiv, helper, interpreting, kernel, next_pow2, tl, use_triton, wait_for_producers

PACK_K = 128


@dataclass
class W4Weight:
    fmt: str  # "int4" or "nvfp4"
    qweight: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group: int  # int4 group size along K; 16 for nvfp4
    global_scale: float = 1.0
    smooth: torch.Tensor | None = None  # pre_quant_scale [K], applied to x (rounded to x's dtype) before the GEMM
    zero_point: torch.Tensor | None = None  # int4 zero points z in [-8, 7], int8 [KP/group, N]; None: symmetric
    zero_scale: torch.Tensor | None = None  # scale * zero_point, fp32 [K/group, N] (w4_zero_point's correction)


# ---- packing (torch, once at load)
def _interleave(u: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [N, KP] -> int32 words [N, KP/8], nibble s of word j = element 8*j + s."""
    n, kp = u.shape
    u = u.reshape(n, kp // 8, 8).to(torch.int64)
    words = sum(u[:, :, s] << (4 * s) for s in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def _deinterleave(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF
    shifts = 4 * torch.arange(8, device=words.device)
    return ((w >> shifts) & 0xF).to(torch.uint8).reshape(words.shape[0], -1)


def _pad_k(t: torch.Tensor, kp: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, kp - t.shape[1]), value=value)


def int4_group(weight, weight_scale) -> int:
    """The group size of modelopt W4A16_AWQ tensors: in_features / number of scale columns."""
    k, groups = weight.shape[1], weight_scale.shape[1]
    if k % groups:
        raise ValueError(f"in_features {k} is not a multiple of the {groups} scale groups")
    return k // groups


def int4_group_supported(group: int) -> bool:
    """The kernel applies one scale per row and 16-wide K slice, or per row and 128-wide tile."""
    return group % 16 == 0 and (PACK_K % group == 0 or group % PACK_K == 0)


def pack_int4(weight, weight_scale, pre_quant_scale=None, zero_point=None) -> W4Weight:
    """modelopt W4A16_AWQ tensors (uint8 [N/2, K], fp32 [N, K/group]) -> W4Weight; zero_point: W4A16_ZP's int8
    [N, K/group] in [-8, 7] (w = (q - zero_point) * scale)."""
    group = int4_group(weight, weight_scale)
    if not int4_group_supported(group):
        raise ValueError(f"group size {group} is not supported by the W4 kernel (need 16 | g and g | 128 or 128 | g)")
    q = unpack_int4_rows(weight)  # int8 [N, K]
    n, k = q.shape
    kp = cdiv(k, PACK_K) * PACK_K
    u = _pad_k((q.to(torch.int16) + 8).to(torch.uint8), kp, 8)
    scales = _pad_k(weight_scale.float(), cdiv(kp, group), 0).t().contiguous()
    w = W4Weight("int4", _interleave(u), scales, n, k, group, 1.0, pre_quant_scale)
    if zero_point is not None:
        if zero_point.shape != weight_scale.shape:
            raise ValueError(f"zero points {tuple(zero_point.shape)} != scales {tuple(weight_scale.shape)}")
        w.zero_point = _pad_k(zero_point.to(torch.int8), cdiv(kp, group), 0).t().contiguous()
        w.zero_scale = w4_zero_point.zero_scale(weight_scale, zero_point)
    return w


def pack_nvfp4(weight, weight_scale, weight_scale_2, pre_quant_scale=None) -> W4Weight:
    """modelopt NVFP4 tensors (uint8 [N, K/2], e4m3 [N, K/16], fp32 scalar) -> W4Weight."""
    codes = unpack_e2m1(weight)
    n, k = codes.shape
    kp = cdiv(k, PACK_K) * PACK_K
    scales = _pad_k(weight_scale.view(torch.uint8), kp // NVFP4_BLOCK, 0).reshape(n, kp // PACK_K, 8)
    scales = scales.permute(1, 0, 2).contiguous()
    return W4Weight("nvfp4", _interleave(_pad_k(codes, kp, 0)), scales.view(torch.float8_e4m3fn), n, k,
                    NVFP4_BLOCK, float(weight_scale_2), pre_quant_scale)


def dequantize_w4(w: W4Weight) -> torch.Tensor:
    """The fp32 weight [N, K] a W4Weight stands for (read back from the kernel layout)."""
    u = _deinterleave(w.qweight)[:, : w.in_features]
    if w.fmt == "int4":
        s = w.scales.t()[:, : w.in_features // w.group].float().repeat_interleave(w.group, dim=1)
        q = u.float() - 8
        if w.zero_point is not None:
            z = w.zero_point.t()[:, : w.in_features // w.group].float()
            q = q - z.repeat_interleave(w.group, dim=1)
        return q * s
    block_scale = w.scales.permute(1, 0, 2).reshape(w.out_features, -1)[:, : w.in_features // NVFP4_BLOCK]
    return nvfp4_dequantize(u, block_scale, torch.tensor(w.global_scale))


def w4a16_gemm_ref(x, w: W4Weight, bias=None):
    """x [M, K] bf16/fp16 -> [M, N] in x's dtype; fp32 math."""
    if w.smooth is not None:
        x = x * w.smooth.to(x.dtype)
    y = x.float() @ dequantize_w4(w).to(x.device).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- kernel
@helper
def _byte_nibbles(wb, sc, IS_FP4: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """uint8 [BN, 64] (a 128-k tile's words as bytes: byte b of word j holds k 8j + 2b low, 8j + 2b + 1 high) ->
    (low, high) nibbles dequantized, [BN, 64] each in the dot's type (bf16 when BF16, else fp16), so that
    reshape(join(low, high), (BN, 128)) is the tile in natural k order. INT4: q = u - 8 (sc unused); NVFP4: the e2m1
    value x 2^-14 times sc, the fp16 block scales [BN, 64] (exact in fp16).
    On the GPU four bytes per inline-asm instance (whichever four the layout gives a thread; every step is per byte):
    PRMT puts bytes 0, 1 (2, 3) in the two 16-bit halves, so one mask (and a shift for the high nibbles) builds the
    pair; sc's elements 0, 1 are register $5, 2, 3 $6."""
    if EMULATE:
        lo, hi = (wb & 0xF).to(tl.int32), (wb >> 4).to(tl.int32)
        if IS_FP4:
            lo = (((lo & 7) << 9) | ((lo & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True) * sc
            hi = (((hi & 7) << 9) | ((hi & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True) * sc
        else:
            dt = tl.bfloat16 if BF16 else tl.float16
            lo, hi = (lo - 8).to(tl.float32).to(dt), (hi - 8).to(tl.float32).to(dt)
    elif IS_FP4:
        lo, hi = tl.inline_asm_elementwise(
            """{ .reg .b32 z, l, h, v, m;
            mov.b32 z, 0; prmt.b32 l, $4, z, 0x4140; prmt.b32 h, $4, z, 0x4342;
            shl.b32 v, l, 9; and.b32 m, v, 0x0e000e00; shl.b32 v, l, 12; lop3.b32 m, v, 0x80008000, m, 0xea;
            mul.rn.f16x2 $0, m, $5;
            shl.b32 v, h, 9; and.b32 m, v, 0x0e000e00; shl.b32 v, h, 12; lop3.b32 m, v, 0x80008000, m, 0xea;
            mul.rn.f16x2 $1, m, $6;
            shl.b32 v, l, 5; and.b32 m, v, 0x0e000e00; shl.b32 v, l, 8; lop3.b32 m, v, 0x80008000, m, 0xea;
            mul.rn.f16x2 $2, m, $5;
            shl.b32 v, h, 5; and.b32 m, v, 0x0e000e00; shl.b32 v, h, 8; lop3.b32 m, v, 0x80008000, m, 0xea;
            mul.rn.f16x2 $3, m, $6; }""",
            "=r,=r,=r,=r,r,r,r", [wb, sc], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    elif BF16:  # (128 + u) from the magic 0x4300, then - 136 (exact)
        lo, hi = tl.inline_asm_elementwise(
            """{ .reg .b32 z, l, h, t, one, off, mg;
            mov.b32 z, 0; mov.b32 one, 0x3f803f80; mov.b32 off, 0xc308c308; mov.b32 mg, 0x43004300;
            prmt.b32 l, $4, z, 0x4140; prmt.b32 h, $4, z, 0x4342;
            lop3.b32 t, l, 0x000f000f, mg, 0xea; fma.rn.bf16x2 $0, t, one, off;
            lop3.b32 t, h, 0x000f000f, mg, 0xea; fma.rn.bf16x2 $1, t, one, off;
            shr.u32 l, l, 4; shr.u32 h, h, 4;
            lop3.b32 t, l, 0x000f000f, mg, 0xea; fma.rn.bf16x2 $2, t, one, off;
            lop3.b32 t, h, 0x000f000f, mg, 0xea; fma.rn.bf16x2 $3, t, one, off; }""",
            "=r,=r,=r,=r,r", [wb], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:  # fp16: magic 0x6400 (1024 + u), - 1032
        lo, hi = tl.inline_asm_elementwise(
            """{ .reg .b32 z, l, h, t, one, off, mg;
            mov.b32 z, 0; mov.b32 one, 0x3c003c00; mov.b32 off, 0xe408e408; mov.b32 mg, 0x64006400;
            prmt.b32 l, $4, z, 0x4140; prmt.b32 h, $4, z, 0x4342;
            lop3.b32 t, l, 0x000f000f, mg, 0xea; fma.rn.f16x2 $0, t, one, off;
            lop3.b32 t, h, 0x000f000f, mg, 0xea; fma.rn.f16x2 $1, t, one, off;
            shr.u32 l, l, 4; shr.u32 h, h, 4;
            lop3.b32 t, l, 0x000f000f, mg, 0xea; fma.rn.f16x2 $2, t, one, off;
            lop3.b32 t, h, 0x000f000f, mg, 0xea; fma.rn.f16x2 $3, t, one, off; }""",
            "=r,=r,=r,=r,r", [wb], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


@helper
def _tile_scales(s_ptr, t, n_rows, N, GROUP: tl.constexpr, IS_FP4: tl.constexpr, ROW_SCALE: tl.constexpr):
    """K tile t's scales as stored: INT4 groups >= 128 fp32 [BN] (one per row); NVFP4 e4m3 [BN, 8] and INT4 groups of
    16-64 fp32 [BN, 8] (one per row and 16-wide block)."""
    s8 = tl.arange(0, 8)
    if ROW_SCALE:
        sc = tl.load(s_ptr + (t * 128 // GROUP) * N + n_rows)
    elif IS_FP4:
        sc = tl.load(s_ptr + (t * N + n_rows[:, None]) * 8 + s8[None, :])
    else:
        sc = tl.load(s_ptr + ((t * 128 + 16 * s8[None, :]) // GROUP) * N + n_rows[:, None])
    return sc


@helper
def _tile_operands(t, sc, x_ptr, offs_m, m_ok, K, smooth_ptr, wb_ptrs, IS_FP4: tl.constexpr,
                   HAS_SMOOTH: tl.constexpr, ROW_SCALE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
    """K tile t (128 k) and its scales sc (_tile_scales) -> (w [BN, 128] in DT, x^T [128, BM] in DT)."""
    BLOCK_N: tl.constexpr = wb_ptrs.shape[0]
    k = t * 128 + tl.arange(0, 128)
    # [128, BLOCK_M]; rows past M masked, not clamped: a clamped row is read BLOCK_M - M + 1 times by every
    # program, and those L2 lines become a hot spot at small M
    xs = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * K + k[:, None], mask=(k[:, None] < K) & m_ok[None, :],
                 other=0.0)
    if HAS_SMOOTH:
        sm = tl.load(smooth_ptr + k, mask=k < K, other=0.0).to(xs.dtype).to(tl.float32)
        xs = (xs.to(tl.float32) * sm[:, None]).to(xs.dtype)
    if not ROW_SCALE:  # byte i of a row's 64 lies in 16-block i // 8
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, 8, 8)), (BLOCK_N, 64))
        if IS_FP4:
            sc = sc.to(DT)
    lo, hi = _byte_nibbles(tl.load(wb_ptrs + t * 64), sc, IS_FP4, DT == tl.bfloat16, EMULATE)
    if not IS_FP4 and not ROW_SCALE:  # q x scale in fp32, rounded once to x's dtype
        lo, hi = (lo.to(tl.float32) * sc).to(DT), (hi.to(tl.float32) * sc).to(DT)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, 128)), xs.to(DT)  # w in natural k order


@kernel
def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, smooth_ptr, bias_ptr, out_ptr, M, N, K, w_stride, n_tiles, tiles_per_split,
                    global_scale, IS_FP4: tl.constexpr, X_BF16: tl.constexpr, GROUP: tl.constexpr,
                    HAS_SMOOTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREFETCH: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: weight loads need no mask, stores are masked
    m_ok = offs_m < M
    # a tile's 16 words per row as 64 bytes: the dot's layout gives each thread bytes of its own k pairs, which
    # Triton then loads from shared memory straight into registers (no dequantized tile in shared memory)
    wb_ptrs = w_ptr.to(tl.pointer_type(tl.uint8)) + n_rows[:, None] * (4 * w_stride) + tl.arange(0, 64)[None, :]
    dt: tl.constexpr = tl.bfloat16 if X_BF16 and not IS_FP4 else tl.float16  # NVFP4: fp16 (exact block scales)
    row_scale: tl.constexpr = not IS_FP4 and GROUP % 128 == 0  # one scale per row and tile
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    if PREFETCH and row_scale:
        sc_next = _tile_scales(s_ptr, t_begin, n_rows, N, GROUP, IS_FP4, row_scale)
    for t in range(t_begin, t_end):
        # INT4's row scales are plain loads used after the dot (Triton's pipeline copies only the dot's operands
        # ahead): PREFETCH loads the next tile's during this one. NVFP4's feed the operand, and Triton already
        # loads them an iteration ahead (on the H200 NVFP4 is 1-15 % slower with it)
        if PREFETCH and row_scale:
            sc = sc_next
            sc_next = _tile_scales(s_ptr, tl.minimum(t + 1, t_end - 1), n_rows, N, GROUP, IS_FP4, row_scale)
        else:
            sc = _tile_scales(s_ptr, t, n_rows, N, GROUP, IS_FP4, row_scale)
        w5, xs = _tile_operands(t, sc, x_ptr, offs_m, m_ok, K, smooth_ptr, wb_ptrs, IS_FP4, HAS_SMOOTH, row_scale, dt,
                                EMULATE)
        if row_scale:
            acc += tl.dot(w5, xs) * sc[:, None]
        else:  # global_scale carries NVFP4's 2**14 back
            acc = tl.dot(w5, xs, acc)
    split_k.store_out_t(acc, out_ptr, bias_ptr, pid_k, M, N, offs_m, offs_n, n_rows, global_scale, HAS_BIAS)


def m_bucket(M: int) -> int:
    """The row ranges of Tuning.w4_gemm_tuned: M = 1, <= 16, <= 32, <= 64, <= 128, <= 512 (bucket 256), more
    (bucket 4096)."""
    return 1 if M == 1 else 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128 if M <= 128 else \
        256 if M <= 512 else 4096


def choose_config(M: int, N: int, KP: int, fmt: str = "int4"):
    """(BLOCK_M, BLOCK_N, split, num_warps, num_stages): Tuning.w4_gemm_tuned's for a tuned shape; otherwise up to
    512 rows take as many K splits (powers of two, >= 4 tiles each) as keep the programs within a budget, more rows
    128x128 tiles."""
    tuned = tuning.current().w4_gemm_tuned.get((fmt, KP, N, m_bucket(M)))
    if tuned is not None:
        return (max(16, next_pow2(M)) if M <= 16 else tuned[0],) + tuned[1:]
    tiles = KP // PACK_K
    if M > 512:
        return 128, 128, 1, 8, 3
    block_m, block_n = min(128, max(16, next_pow2(M))), 64
    budget = 2048 // (block_m // 16) // cdiv(M, block_m)
    split = 1
    while split * 2 * cdiv(N, block_n) <= budget and tiles // (split * 2) >= 4:
        split *= 2
    return block_m, block_n, split, 4, 3


def w4a16_gemm(x, w: W4Weight, bias=None, config=None):
    """x [M, K] bf16/fp16 -> [M, N] in x's dtype, on the kernel lowbit.kernels.routes picks: w4_mma, the CUDA-core
    GEMV (w4_gemv), the dequantized weight through cuBLAS (w4_dequant), w4_small_m or the tensor-core kernel below
    (which an explicit tensor-core `config` runs directly). Zero points: as routes.ZERO_POINT says
    (lowbit.kernels.linear.w4_zero_point)."""
    if not use_triton(x):
        return w4a16_gemm_ref(x, w, bias)
    if w.zero_point is not None:
        return w4_zero_point.zp_gemm(x, w, bias, lambda xs, b: _symmetric_gemm(xs, w, b, config))
    return _symmetric_gemm(x, w, bias, config)


def _symmetric_gemm(x, w: W4Weight, bias=None, config=None):
    """w4a16_gemm on the codes and scales alone (q * s: a zero-point weight's correction is not applied)."""
    if config is not None:
        return _tensor_core_kernel(x, w, bias, config)
    kernel = _route(x, w)
    if kernel == "w4_mma":
        return w4_mma.w4_mma(x, w, bias)
    if kernel == "w4_gemv":
        return w4_gemv.w4_gemv(x, w, bias)
    if kernel == "w4_dequant":
        y = w4_dequant.dequant_linear(x.contiguous(), w, bias)
        if y is not None:  # None: a graph capture found the scratch too small
            return y
    return tensor_core_gemm(x, w, bias)


def _route(x, w: W4Weight, only=None) -> str:
    """The kernel routes.LINEAR picks (only asked where the kernels run: the W4 rows do not test the GPU)."""
    return routes.route("linear", w.fmt, x.shape[0], w.out_features, w.in_features, None, group=w.group,
                        x16=x.dtype in (torch.bfloat16, torch.float16), only=only)


def tensor_core_gemm(x, w: W4Weight, bias=None, config=None):
    """w4a16_gemm without the GEMVs and the dequant path: w4_small_m where the routes give it the shape, else (or
    with an explicit config) the tensor-core kernel below."""
    if config is None and _route(x, w, only=routes.W4_TENSOR_CORE) == "w4_small_m":
        return w4_small_m.w4_small_m(x.contiguous(), w, bias)
    return _tensor_core_kernel(x, w, bias, config)


def _tensor_core_kernel(x, w: W4Weight, bias=None, config=None):
    x = x.contiguous()
    M, K = x.shape
    N, KP = w.out_features, w.qweight.shape[1] * 8
    block_m, block_n, split, warps, stages = config or choose_config(M, N, KP, w.fmt)
    tiles = KP // PACK_K
    tiles_per_split = cdiv(tiles, split)
    split = cdiv(tiles, tiles_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    target = split_k.partials_or_out(split, out)
    grid = (cdiv(N, block_n), split, cdiv(M, block_m))
    _w4_gemm_kernel[grid](
        x, w.qweight, w.scales, w.smooth if w.smooth is not None else x, bias if bias is not None else x,
        target, M, N, K, KP // 8, tiles, tiles_per_split, w.global_scale * (2.0**14 if w.fmt == "nvfp4" else 1.0),
        IS_FP4=w.fmt == "nvfp4", X_BF16=x.dtype == torch.bfloat16, GROUP=w.group,
        HAS_SMOOTH=w.smooth is not None, HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=block_m, BLOCK_N=block_n, PREFETCH=tuning.current().w4_prefetch_scales, EMULATE=interpreting(),
        num_warps=warps, num_stages=stages)
    if split > 1:
        split_k.split_sum(target, bias, out)
    return out
