"""Small-batch (2 <= M <= SMALL_M_MAX) weight-only 4-bit GEMM on tensor cores, weights dequantized in registers.

Same W4Weight layout as lowbit.kernels.linear.w4a16 (qweight int32 [N, KP/8], nibble s of word j = element 8j + s).
A K tile of 128 is 16 words per row. Instead of unpacking a tile to [BLOCK_N, 128] (a reshape: Triton routes the
16-bit tile through shared memory to reach the MMA's operand layout, 4x the weight bytes), the tile is cut into
8 nibble planes: plane s = (words >> 4s) & 15, [BLOCK_N, 16], holds elements k = 8j + s. Each plane is a pure
elementwise function of the loaded words, so the words go from shared memory straight into the MMA's register
operand, and the tile is 8 dots of K = 16 against the matching x columns x[:, 8j + s]. Those are strided in x, so
x_planes first copies x (tiny at M <= 16) into plane order, where each plane's columns are 16 contiguous values:
Triton then streams them to shared memory asynchronously for the MMA, as it does the words.
acc [BLOCK_N, BLOCK_M] = W_tile @ x^T: small M sits in the MMA's N dimension.
- INT4: (u | 0x4300) as bf16 is 128 + u exactly (fp16: 0x6400, 1024 + u); minus 136 (1032) gives q = u - 8. Groups
  of 128 or more: the 8 dots accumulate in fp32 and the tile's sum is scaled per row. Smaller groups: q times its
  scale, rounded to x's dtype, before the dot (as w4a16).
- NVFP4: the e2m1 code's bits placed in an fp16 (value * 2^-14, exact) times the e4m3 block scale (exact in fp16),
  fp16 dots; the global scale and 2^14 are applied once at the end (as w4a16).
Splits K across programs when N alone gives too few programs; partials are summed by
lowbit.kernels.linear.split_k.
"""
import torch
import torch.nn.functional as F

from lowbit.kernels import routes
from lowbit.kernels.linear import split_k
from lowbit.kernels._triton import cdiv, helper, kernel, tl, use_triton, wait_for_producers

SMALL_M_MAX = 16  # one MMA N tile (BLOCK_M = 16)
TILE_K = 128  # w4a16.PACK_K: 16 words per row (the kernel's literal 128)


@helper
def _plane(words, s: tl.constexpr, sc, IS_FP4: tl.constexpr, X_BF16: tl.constexpr, SCALE_W: tl.constexpr):
    """Nibble plane s of words [BN, 16] -> the weights of elements 8j + s [BN, 16] in the dot's dtype."""
    u = (words >> (4 * s)) & 0xF
    if IS_FP4:
        w = (((u & 7) << 9) | ((u & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True) * sc
    elif X_BF16:
        w = ((u | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0).to(tl.bfloat16)
    else:
        w = ((u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0).to(tl.float16)
    if SCALE_W and not IS_FP4:  # one scale per row and word (groups < 128): dequantize, rounded to x's dtype
        w = (w.to(tl.float32) * sc).to(w.dtype)
    return w


@kernel
def _w4_small_m_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, KP, w_stride, n_tiles, tiles_per_split,
                       global_scale, IS_FP4: tl.constexpr, X_BF16: tl.constexpr, GROUP: tl.constexpr,
                       HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, 16)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: weight loads need no mask, stores are masked
    w_ptrs = w_ptr + n_rows[:, None] * w_stride + jj[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * KP + jj[:, None]  # [16, BM]: plane 0 of tile 0
    m_ok = offs_m[None, :] < M  # rows past M masked, not clamped: no program reads a row twice
    SCALE_W: tl.constexpr = IS_FP4 or GROUP % 128 != 0
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    for t in range(t_begin, t_end):
        words = tl.load(w_ptrs + t * 16)  # [BN, 16] int32
        x0 = tl.load(x_ptrs + t * 128 + 0, mask=m_ok, other=0.0)
        x1 = tl.load(x_ptrs + t * 128 + 16, mask=m_ok, other=0.0)
        x2 = tl.load(x_ptrs + t * 128 + 32, mask=m_ok, other=0.0)
        x3 = tl.load(x_ptrs + t * 128 + 48, mask=m_ok, other=0.0)
        x4 = tl.load(x_ptrs + t * 128 + 64, mask=m_ok, other=0.0)
        x5 = tl.load(x_ptrs + t * 128 + 80, mask=m_ok, other=0.0)
        x6 = tl.load(x_ptrs + t * 128 + 96, mask=m_ok, other=0.0)
        x7 = tl.load(x_ptrs + t * 128 + 112, mask=m_ok, other=0.0)
        if IS_FP4:  # the block scale of element 8j + s is block j // 2 of the tile's 8
            sc = tl.load(s_ptr + (t * N + n_rows[:, None]) * 8 + jj[None, :] // 2).to(tl.float16)
        elif SCALE_W:
            sc = tl.load(s_ptr + ((t * 128 + 8 * jj[None, :]) // GROUP) * N + n_rows[:, None])
        else:
            sc = tl.load(s_ptr + (t * 128 // GROUP) * N + n_rows)
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        part = tl.dot(_plane(words, 0, sc, IS_FP4, X_BF16, SCALE_W), x0, part)
        part = tl.dot(_plane(words, 1, sc, IS_FP4, X_BF16, SCALE_W), x1, part)
        part = tl.dot(_plane(words, 2, sc, IS_FP4, X_BF16, SCALE_W), x2, part)
        part = tl.dot(_plane(words, 3, sc, IS_FP4, X_BF16, SCALE_W), x3, part)
        part = tl.dot(_plane(words, 4, sc, IS_FP4, X_BF16, SCALE_W), x4, part)
        part = tl.dot(_plane(words, 5, sc, IS_FP4, X_BF16, SCALE_W), x5, part)
        part = tl.dot(_plane(words, 6, sc, IS_FP4, X_BF16, SCALE_W), x6, part)
        part = tl.dot(_plane(words, 7, sc, IS_FP4, X_BF16, SCALE_W), x7, part)
        if SCALE_W:
            acc += part
        else:
            acc += part * sc[:, None]
    split_k.store_out_t(acc, out_ptr, bias_ptr, pid_k, M, N, offs_m, offs_n, n_rows, global_scale, HAS_BIAS)


def w4_small_m(x, w, bias=None, config=None):
    """x [M, K] bf16/fp16, 2 <= M <= SMALL_M_MAX -> [M, N] in x's dtype; w a lowbit.kernels.linear.w4a16.W4Weight.
    config (BLOCK_N, split, num_warps, num_stages[, BLOCK_M]), default choose_config; BLOCK_M 16 (the default) or 32:
    rows past M are masked, and at 8 warps a 32-wide x plane (1 KB) still gives every thread a 4-byte
    asynchronous copy (at 16 wide Triton loads it synchronously, with a fence per plane: 8 MEMBAR in its SASS)."""
    assert use_triton(x)
    x = x.contiguous()
    M, K = x.shape
    assert M <= SMALL_M_MAX, M
    N, KP = w.out_features, w.qweight.shape[1] * 8
    block_n, split, warps, stages, *block_m = config or choose_config(M, N, KP, w.fmt)
    tiles = KP // TILE_K
    tiles_per_split = cdiv(tiles, split)
    split = cdiv(tiles, tiles_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    target = split_k.partials_or_out(split, out)
    _w4_small_m_kernel[(cdiv(N, block_n), split)](
        x_planes(x, w), w.qweight, w.scales, bias if bias is not None else x, target, M, N, KP, KP // 8, tiles,
        tiles_per_split, w.global_scale * (2.0**14 if w.fmt == "nvfp4" else 1.0), IS_FP4=w.fmt == "nvfp4",
        X_BF16=x.dtype == torch.bfloat16, GROUP=w.group, HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=block_m[0] if block_m else 16, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    if split > 1:
        split_k.split_sum(target, bias, out)
    return out


def x_planes(x, w) -> torch.Tensor:
    """x [M, K] -> [M, KP] in the dot's dtype (fp16 for NVFP4), each 128-tile in nibble-plane order: element
    16s + j of tile t is x[128t + 8j + s] (times pre_quant_scale, rounded to x's dtype, as the reference)."""
    if w.smooth is not None:
        x = (x.float() * w.smooth.to(x.dtype).float()).to(x.dtype)
    M, K = x.shape
    KP = w.qweight.shape[1] * 8
    x = F.pad(x, (0, KP - K)) if KP > K else x
    dtype = torch.float16 if w.fmt == "nvfp4" else x.dtype
    return x.view(M, KP // TILE_K, 16, 8).transpose(2, 3).to(dtype).contiguous()


def takes(M: int, N: int, KP: int, fmt: str) -> bool:
    """The routes give this kernel M rows of an N x KP weight of kind fmt (among the tensor-core kernels): large
    INT4 layers at 2 <= M <= SMALL_M_MAX (lowbit.kernels.routes, Tuning.w4_small_m_min_weights)."""
    return routes.route("linear", fmt, M, N, KP, None, only=routes.W4_TENSOR_CORE) == "w4_small_m"


def choose_config(M: int, N: int, KP: int, fmt: str):
    """(BLOCK_N, split, num_warps, num_stages): 128-row tiles, K split in up to 8 (powers of two, >= 4 tiles each)
    while the grid stays within 1024 programs; the sweep's winners for gate_up (split 4) and down (split 8)."""
    block_n, tiles, split = 128, KP // TILE_K, 1
    while split < 8 and split * 2 * cdiv(N, block_n) <= 1024 and tiles // (split * 2) >= 4:
        split *= 2
    return block_n, split, 4, 3
