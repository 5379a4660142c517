"""Prefill / extend attention over paged KV (also chunked prefill), the query heads of one KV head in one program.

Same contract as lowbit.kernels.attention.paged_attention.paged_prefill_ref. A program takes BLOCK_T new tokens of one
sequence times the G query heads that share a KV head, G padded to a power of two GP: M = BLOCK_T * GP rows
[token-major: row r = token r // GP, head r % GP; heads >= G masked], so each K/V tile is loaded (and, for an FP8
cache, converted) once for G heads. Keys below the tile's first query position are visible to every row: those
tiles run without the causal mask; only the last tiles (at most ceil(BLOCK_T / BLOCK_N) + 1) are masked.
With a sliding window W (constexpr WINDOW) a tile reads keys from the cache block holding its first query's first
visible key (position first - W + 1) on, every tile masked; blocks wholly before it are never loaded.
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels._triton import cdiv, helper, kernel, next_pow2, tl, wait_for_producers
from lowbit.kernels.attention.paged_attention import (LOG2E, _block_ids, _kv_blocks, _kv_tile, _output, _scale_tensor,
                                                      _softmax_step, block_gather_fits)
from lowbit.kernels.tuning import PrefillTiles


@helper
def _tile(kv_ptr, bt_ptr, bt_row, n0, end, kvh, offs_d, half_stride, HKD: tl.constexpr, D: tl.constexpr,
          BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, V_T: tl.constexpr):
    """K [BLOCK_N, D] and V [BLOCK_N, D] (V_T: [D, BLOCK_N]) of tokens n0.. (< end; rows past it are zeros, or
    with BLOCKS copies of token end - 1)."""
    if BLOCKS:
        NB: tl.constexpr = BLOCK_N // BS
        blk = _block_ids(bt_ptr, bt_row, n0, end - 1, BS, NB)
        return _kv_blocks(kv_ptr, blk, n0, end - 1, kvh, half_stride, HKD, D, BS, NB, V_T)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return _kv_tile(kv_ptr, bt_ptr, bt_row, offs_n, offs_n < end, kvh, offs_d, half_stride, HKD, D, BS, V_T)


@kernel
def _prefill_kernel(q_ptr, kv_ptr, bt_ptr, qsl_ptr, ctx_ptr, ks_ptr, vs_ptr, os_ptr, out_ptr, qk_scale, bt_stride,
                    half_stride, window, softcap, HQ: tl.constexpr, HKD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                    D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                    FP8: tl.constexpr, QUANT_OUT: tl.constexpr, BLOCKS: tl.constexpr, DOT_ACC: tl.constexpr,
                    HEAVY_FIRST: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr):
    """Program (token tile, b, kv head), or with HEAVY_FIRST (kv head, b, last tile first): rows = BLOCK_T new tokens
    x the G query heads of KV head kvh. DOT_ACC: PrefillTiles.dot_acc. WINDOW: keys j > pos - window only;
    SOFTCAP: _softmax_step's (softcap in the log2 domain)."""
    wait_for_producers(PDL)
    M: tl.constexpr = BLOCK_T * GP
    if HEAVY_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        t0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_T
    else:
        t0 = tl.program_id(0) * BLOCK_T
        b = tl.program_id(1).to(tl.int64)
        kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if t0 >= q_len:
        return
    ctx_len = tl.load(ctx_ptr + b)
    first = ctx_len - q_len + t0  # absolute position of the tile's first token
    offs_r = tl.arange(0, M)
    tok = t0 + offs_r // GP
    mask_r = (tok < q_len) & (offs_r % GP < G)
    pos = first + offs_r // GP
    rows = (q_start + tok).to(tl.int64) * HQ + kvh * G + offs_r % GP
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_r[:, None], other=0.0)
    k_scale, v_scale = 1.0, 1.0
    if FP8:  # FP8 K/V become fp16 (exact), so q and P run in fp16
        k_scale, v_scale = tl.load(ks_ptr), tl.load(vs_ptr)
        q = q.to(tl.float16)
    qk_scale = qk_scale * k_scale
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    full_end = (first + 1) // BLOCK_N * BLOCK_N  # keys < first + 1 are visible to every row
    end = tl.minimum(ctx_len, first + BLOCK_T)
    bt_row = b * bt_stride
    if WINDOW:  # from the block of the first row's first visible key; every tile masked
        m = tl.full([M], -1.0e30, tl.float32)  # finite: a later row's first tiles may lie wholly before its window
        lo = tl.maximum(first - window + 1, 0) // BS * BS
        for n0 in range(lo, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, v = _tile(kv_ptr, bt_ptr, bt_row, n0, end, kvh, offs_d, half_stride, HKD, D, BS, BLOCK_N, BLOCKS,
                         FP8)
            valid = ((offs_n[None, :] < end) & (offs_n[None, :] <= pos[:, None])
                     & (offs_n[None, :] > pos[:, None] - window))
            m, l, acc = _softmax_step(q, k, v, valid, m, l, acc, qk_scale, v_scale, True, FP8, DOT_ACC, softcap,
                                      SOFTCAP)
    else:
        for n0 in range(0, full_end, BLOCK_N):
            k, v = _tile(kv_ptr, bt_ptr, bt_row, n0, full_end, kvh, offs_d, half_stride, HKD, D, BS, BLOCK_N, BLOCKS,
                         FP8)
            m, l, acc = _softmax_step(q, k, v, None, m, l, acc, qk_scale, v_scale, False, FP8, DOT_ACC, softcap,
                                      SOFTCAP)
        for n0 in range(full_end, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, v = _tile(kv_ptr, bt_ptr, bt_row, n0, end, kvh, offs_d, half_stride, HKD, D, BS, BLOCK_N, BLOCKS,
                         FP8)
            valid = (offs_n[None, :] < end) & (offs_n[None, :] <= pos[:, None])
            m, l, acc = _softmax_step(q, k, v, valid, m, l, acc, qk_scale, v_scale, True, FP8, DOT_ACC, softcap,
                                      SOFTCAP)
    if WINDOW:  # padding rows past the last query may see no key in the window: l = 0 there (never stored)
        l = tl.where(l > 0, l, 1.0)
    if DOT_ACC:
        o = acc * (v_scale / l)[:, None]
    else:
        o = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], _output(o, os_ptr, q_ptr.dtype.element_ty, QUANT_OUT),
             mask=mask_r[:, None])


def paged_prefill(q, kv_cache, query_start_loc, context_lens, block_tables, max_query_len, scale,
                  k_scale, v_scale, out_scale=None, config: PrefillTiles | None = None, sliding_window: int | None = None,
                  logit_softcap: float | None = None) -> torch.Tensor:
    """Triton: same contract as paged_prefill_ref. max_query_len (host int) sizes the grid. sliding_window,
    logit_softcap: constexpr switches (None compiles the kernel without them)."""
    t, hq, d = q.shape
    _, _, bs, hk, _ = kv_cache.shape
    g = hq // hk
    gp = next_pow2(g)
    q = q.contiguous()
    out = torch.empty_like(q, dtype=q.dtype if out_scale is None else torch.float8_e4m3fn)
    os_ = _scale_tensor(out_scale, q.device) if out_scale is not None else q
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    ks, vs = (_scale_tensor(k_scale, q.device), _scale_tensor(v_scale, q.device)) if fp8 else (q, q)
    tiles = PrefillTiles(*(config or tuning.current().prefill_tiles[fp8, max_query_len > 256]))
    block_t = max(tiles.block_t, 16 // gp)  # tl.dot needs >= 16 rows
    blocks = tiles.blocks and block_gather_fits(tiles.block_n, bs)
    grid = (cdiv(max_query_len, block_t), block_tables.shape[0], hk)
    if tiles.heavy_first:
        grid = grid[::-1]
    _prefill_kernel[grid](q, kv_cache, block_tables, query_start_loc, context_lens, ks, vs, os_, out, scale * LOG2E,
                          block_tables.stride(0), kv_cache.stride(0), sliding_window or 0,
                          (logit_softcap or 1.0) * LOG2E, HQ=hq, HKD=hk * d, G=g, GP=gp, D=d, BS=bs,
                          BLOCK_T=block_t, BLOCK_N=tiles.block_n, FP8=fp8, QUANT_OUT=out_scale is not None,
                          BLOCKS=blocks, DOT_ACC=tiles.dot_acc, HEAVY_FIRST=tiles.heavy_first,
                          WINDOW=sliding_window is not None, SOFTCAP=logit_softcap is not None,
                          num_warps=tiles.warps, num_stages=tiles.stages)
    return out
