"""Decode (M = 1) FP8 GEMV: out[1, N] = (x_q[1, K] @ w_q[N, K]^T) * scale_a * scale_b (+ bias), CUDA cores, no tl.dot.

Same contract as fp8_small_m_gemm at M = 1: x_q [1, K] and w_q [N, K] float8_e4m3fn, K-contiguous (the checkpoint
layout, no repack), K % 4 == 0; scale_a fp32 [] or [1, 1]; scale_b fp32 [] or [N] / [N, 1]; bias [N] or None; fp32
accumulation; out_dtype bf16 / fp16 (fp32 too, for accuracy checks).

Each program owns BLOCK_N output rows over all of K (no split-K: no workspace, no second pass, one launch):
- x and w are read as int32 words of 4 e4m3. A K step is C = BLOCK_K / 16 chunks of 16 k (4 words); chunk c goes
  to thread c % (32 x num_warps), and every thread holds all BLOCK_N rows of its chunks: one 16-byte weight load per
  row and chunk (.cg: L2 only; a warp reads 512 contiguous bytes of a row per load) and one 16-byte x load per
  chunk, shared by the rows. Weights [BN, C, 4], x [1, C, 4] and the accumulator [BN, C] share one register layout
  (rows outermost: with chunks outermost the coalescer spreads threads over rows), no shared memory in the loop.
- The loads of the next AHEAD (1 or 2) steps are issued before a step's math; the last steps are peeled (no
  redundant loads). ptxas places a step's loads late in the loop body, hence AHEAD = 2 for more bytes in flight.
- e4m3 -> fp32 is exact (inline PTX on the GPU: 2 cvt.rn.f16x2.e4m3x2 + 4 cvt.f32.f16 per word) and so is every
  e4m3 x e4m3 product (4 x 4 significant bits; exponents -18..17): one fp32 FMA chain per row and thread; the only
  roundings are fp32 sums and the output's.
- Epilogue: sum over chunks, * scale_a * scale_b[n] (+ bias[n]), one rounding. Rows past N are clamped on load
  and masked on store; words past K (EVEN_K false) load 0 for w and x (16-byte vectors still, whenever 16 | K).
- Offline SASS (triton 3.9, sm_90, 8x1024x2x1 loop body): 2.98 instructions per weight, 78 registers.
"""
from typing import NamedTuple

import torch

from lowbit.kernels._triton import cdiv, helper, interpreting, kernel, tl, use_triton


class GemvConfig(NamedTuple):
    block_n: int  # output rows per program
    block_k: int  # k per step: a multiple of 512 x num_warps (whole 16-byte chunks for every thread)
    num_warps: int
    ahead: int = 1  # K steps whose loads are issued before a step's math: 1 or 2 (2: twice the weight registers)


# Not measured yet (bench/fp8_gemv_bench.py sweeps these): 1 KB of weights per row and step over 2 warps, the
# shape of the W4 GEMV's winner (w4_gemv.GEMV_CONFIG streams 1 KB of packed nibbles per row and step).
DEFAULT_CONFIG = GemvConfig(8, 1024, 2)
CANDIDATES = (
    DEFAULT_CONFIG,
    GemvConfig(8, 1024, 2, 2),
    GemvConfig(4, 1024, 2),
    GemvConfig(4, 1024, 2, 2),
    GemvConfig(8, 2048, 4),
    GemvConfig(16, 512, 1),
)


def choose_config(N: int, K: int, sms: int = 132) -> GemvConfig:
    """From shapes only: DEFAULT_CONFIG, or 4 rows per program when 8 would leave fewer than 2 programs per SM."""
    if cdiv(N, DEFAULT_CONFIG.block_n) < 2 * sms:
        return DEFAULT_CONFIG._replace(block_n=4)
    return DEFAULT_CONFIG


def fp8_gemv(q, w, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, config=None):
    """q [1, K] fp8, w [N, K] fp8 -> [1, N] out_dtype; K % 4 == 0 (whole 32-bit words; every checkpoint's K is a
    multiple of 16, as torch._scaled_mm requires). config a GemvConfig (default choose_config(N, K))."""
    assert use_triton(q)
    q = q.contiguous()
    M, K = q.shape
    N = w.shape[0]
    assert M == 1, "the GEMV takes M = 1"
    assert w.shape[1] == K and w.stride() == (K, 1), "w must be [N, K] row-major"
    assert K % 4 == 0, f"K = {K}: the GEMV loads 32-bit words of 4 e4m3"
    scale_a, scale_b = scale_a.float().reshape(-1), scale_b.float().reshape(-1)
    assert scale_a.numel() == 1 and scale_b.numel() in (1, N), (scale_a.shape, scale_b.shape)
    block_n, block_k, warps, ahead = config or choose_config(N, K)
    assert block_k % (512 * warps) == 0 and ahead in (1, 2), (block_k, warps, ahead)
    out = torch.empty(M, N, dtype=out_dtype, device=q.device)
    _fp8_gemv_kernel[(cdiv(N, block_n),)](
        q.view(torch.int32), w.view(torch.int32), out, scale_a, scale_b, bias if bias is not None else scale_b,
        N, K // 4, SB_PER_ROW=scale_b.numel() > 1, HAS_BIAS=bias is not None, EVEN_K=K % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, AHEAD=ahead, USE_ASM=not interpreting(), num_warps=warps)
    return out


@helper
def _split4(t):
    """[A, B, 4] -> 4 tensors [A, B] (element i of the last axis)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))  # a: i = 0, 2; b: i = 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@helper
def _e4m3x4(wd, USE_ASM: tl.constexpr):
    """int32 words of 4 e4m3 (byte 0 = bits 0..7) -> 4 fp32 tensors, exact."""
    if USE_ASM:  # 2 cvt.rn.f16x2.e4m3x2 + 4 cvt.f32.f16 per word (Triton's fp8 -> fp32 unpacks and repacks bytes
        # first: ~2.7x the instructions per weight in the loop, sm_90 SASS)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, h0, h1, h2, h3; .reg .b32 p, q; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi; mov.b32 {h0, h1}, p; mov.b32 {h2, h3}, q; "
            "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
            "=r,=r,=r,=r,r", [wd], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    v0 = (wd & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v1 = ((wd >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v2 = ((wd >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v3 = ((wd >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v0, v1, v2, v3


@helper
def _fma_word(acc, wd, xd, USE_ASM: tl.constexpr):
    """acc [BN, C] += the 4 products of word wd [BN, C] and x word xd [1, C] (exact products, fp32 chain)."""
    v0, v1, v2, v3 = _e4m3x4(wd, USE_ASM)
    a0, a1, a2, a3 = _e4m3x4(xd, USE_ASM)  # once per chunk, shared by the BN rows
    acc = v0 * a0 + acc
    acc = v1 * a1 + acc
    acc = v2 * a2 + acc
    acc = v3 * a3 + acc
    return acc


@helper
def _fma_step(acc, words, xw, USE_ASM: tl.constexpr):
    """acc [BN, C] += sum over each chunk's 16 k of words [BN, C, 4] x xw [1, C, 4] (int32 words of 4 e4m3)."""
    w0, w1, w2, w3 = _split4(words)
    x0, x1, x2, x3 = _split4(xw)
    acc = _fma_word(acc, w0, x0, USE_ASM)
    acc = _fma_word(acc, w1, x1, USE_ASM)
    acc = _fma_word(acc, w2, x2, USE_ASM)
    acc = _fma_word(acc, w3, x3, USE_ASM)
    return acc


@helper
def _load_step(w_ptrs, x_ptrs, k0, kw, KW, EVEN_K: tl.constexpr):
    """Words of the step at word k0: weights [BN, C, 4], x [1, C, 4]; kw [1, C, 4] = the step's word - k0
    (words past KW load 0)."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0, cache_modifier=".cg")
        x = tl.load(x_ptrs + k0)
    else:
        k_ok = k0 + kw < KW
        w = tl.load(w_ptrs + k0, mask=k_ok, other=0, cache_modifier=".cg")
        x = tl.load(x_ptrs + k0, mask=k_ok, other=0)
    return w, x


@kernel
def _fp8_gemv_kernel(x_ptr, w_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, N, KW,
                     SB_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, USE_ASM: tl.constexpr):
    """x_ptr, w_ptr: int32 views (KW = K / 4 words per row)."""
    C: tl.constexpr = BLOCK_K // 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads need no mask on N, the store is masked
    kw = (4 * tl.arange(0, C)[:, None] + tl.arange(0, 4)[None, :])[None, :, :]  # [1, C, 4] words of the step
    w_ptrs = w_ptr + n_rows[:, None, None] * KW + kw  # [BN, C, 4]: rows outermost, so threads split C, not rows
    x_ptrs = x_ptr + kw
    acc = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    n_steps = tl.cdiv(KW, BLOCK_K // 4)
    w, x = _load_step(w_ptrs, x_ptrs, 0, kw, KW, EVEN_K)
    if AHEAD == 1:
        for kb in range(1, n_steps):
            w_next, x_next = _load_step(w_ptrs, x_ptrs, kb * (BLOCK_K // 4), kw, KW, EVEN_K)
            acc = _fma_step(acc, w, x, USE_ASM)
            w, x = w_next, x_next
        acc = _fma_step(acc, w, x, USE_ASM)
    else:  # two steps in flight during the math (ptxas issues a step's loads late in the loop body)
        w1, x1 = _load_step(w_ptrs, x_ptrs, tl.minimum(1, n_steps - 1) * (BLOCK_K // 4), kw, KW, EVEN_K)
        for kb in range(2, n_steps):
            w2, x2 = _load_step(w_ptrs, x_ptrs, kb * (BLOCK_K // 4), kw, KW, EVEN_K)
            acc = _fma_step(acc, w, x, USE_ASM)
            w, x, w1, x1 = w1, x1, w2, x2
        acc = _fma_step(acc, w, x, USE_ASM)
        if n_steps > 1:
            acc = _fma_step(acc, w1, x1, USE_ASM)
    out = tl.sum(acc, axis=1) * tl.load(sa_ptr)
    if SB_PER_ROW:
        out = out * tl.load(sb_ptr + n_rows)
    else:
        out = out * tl.load(sb_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + n_rows).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)
