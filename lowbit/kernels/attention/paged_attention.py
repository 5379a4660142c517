"""Paged attention over one KV tensor per layer: KV store and decode (split along the context); the references of
decode and prefill/extend (whose kernel is lowbit.kernels.attention.paged_prefill) and the tile helpers both
kernels share.

kv_cache [2, num_blocks, block_size, Hk, D], model dtype or float8_e4m3fn holding k / k_scale (v / v_scale).
Token p of sequence b lives in slot block_tables[b, p // block_size] * block_size + p % block_size. An FP8 cache
stores V transposed within each block, [num_blocks, Hk, D, block_size] (token dim contiguous: the P.V product's
operand as the tensor cores take it, copied asynchronously with no register transpose); `v_blocks` gives V in token
order either way.
Grouped-query: query head h reads KV head h // (Hq // Hk). Every op has a torch reference of the same signature.
Launchers take device tensors only (no host sync), so decode can be captured in a CUDA graph.
With out_scale (the o_proj's static FP8 input scale) decode and prefill write their output as float8_e4m3fn.
"""
import torch
import torch.nn.functional as F

from lowbit.kernels import tuning
from lowbit.kernels._triton import cdiv, helper, kernel, next_pow2, tl, wait_for_producers
from lowbit.kernels.ops.norm import quantize_fp8_ref
from lowbit.kernels.tuning import DecodeVariant

FP8_MAX = 448.0


def decode_variant(batch: int, num_kv_heads: int, fp8: bool) -> DecodeVariant:
    """The tiles for a decode launch: from shapes only, so one CUDA graph per batch size stays valid."""
    t = tuning.current()
    if not fp8:
        return t.decode_variants["rows64"]
    return t.decode_variants["blk32w2s3" if batch * num_kv_heads >= t.decode_full_grid else "blk64w2s3"]


# ---- cache layout and references
def v_blocks(kv_cache) -> torch.Tensor:
    """The V half as [num_blocks, block_size, Hk, D] in token order: kv_cache[1] itself, or for an FP8 cache (V
    transposed within each block) a strided view of its transposed blocks."""
    v = kv_cache[1]
    if kv_cache.dtype != torch.float8_e4m3fn:
        return v
    nb, bs, hk, d = v.shape
    return v.view(nb, hk, d, bs).permute(0, 3, 1, 2)


def store_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale) -> None:
    """k, v [T, Hk, D] -> the cache at slot // block_size, slot % block_size; slots < 0 are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // kv_cache.shape[2], slots % kv_cache.shape[2]
    for half, x, s in ((kv_cache[0], k, k_scale), (v_blocks(kv_cache), v, v_scale)):
        _bits(half)[blk, off] = _bits(_quantize(x[keep], s, kv_cache.dtype))


def _bits(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _quantize(x, scale, dtype):
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def gather_kv(kv_cache, table, n, scale_k, scale_v, dtype, start: int = 0):
    """table: one sequence's block-table row -> its tokens [start, n) as k, v [n - start, Hk, D], dequantized to
    dtype. start: a multiple of the block size (blocks before it are not read: a window may have freed them)."""
    bs = kv_cache.shape[2]
    if start % bs:
        raise ValueError(f"gather_kv: start {start} is not a multiple of the block size {bs}")
    blocks = table[start // bs:cdiv(n, bs)].long()
    out = []
    for half, s in ((kv_cache[0], scale_k), (v_blocks(kv_cache), scale_v)):
        x = _bits(half)[blocks].flatten(0, 1)[:n - start].view(kv_cache.dtype)
        out.append((x.float() * s).to(dtype) if x.dtype == torch.float8_e4m3fn else x.to(dtype))
    return out


def window_start(first_pos: int, sliding_window: int | None, block_size: int) -> int:
    """The first cached token a query at position first_pos (or any later one) can see, rounded down to its block:
    0 without a window, else first_pos - W + 1 (query i sees keys j with i - W < j <= i)."""
    if sliding_window is None:
        return 0
    return max(0, first_pos - sliding_window + 1) // block_size * block_size


def attention_ref(q, k, v, query_pos, key_pos, scale, sliding_window=None, logit_softcap=None) -> torch.Tensor:
    """q [B, Hq, M, D], k, v [B, Hk, N, D] (Hq a multiple of Hk), query_pos [B, M] / key_pos [B, N] or [N] token
    positions (key_pos < 0: padding) -> [B, Hq, M, D] in q's dtype. Query i sees keys j with pos_j <= pos_i (and
    pos_i - W < pos_j with a window W); softcap c: scores = c * tanh(scores / c) before the mask and softmax
    (transformers' eager attention). Without a softcap, SDPA; with one, fp32 math."""
    qp, kp = query_pos[..., :, None], key_pos[..., None, :]
    mask = (kp <= qp) & (kp >= 0)
    if sliding_window is not None:
        mask = mask & (kp > qp - sliding_window)
    mask = mask[:, None] if mask.dim() == 3 else mask  # [B, 1, M, N] or [M, N]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ kf.transpose(-1, -2) * scale
    s = logit_softcap * torch.tanh(s / logit_softcap)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return (p @ vf).to(q.dtype)


def paged_prefill_ref(q, kv_cache, query_start_loc, context_lens, block_tables, max_query_len, scale,
                      k_scale, v_scale, out_scale=None, sliding_window=None, logit_softcap=None) -> torch.Tensor:
    """q [T, Hq, D] (the new tokens of all sequences) -> [T, Hq, D]; query i of b sits at ctx_len - q_len + i.
    out_scale (the next linear's static FP8 input scale): the output, in q's dtype, quantized to float8_e4m3fn.
    sliding_window W: query at position i sees keys j with i - W < j <= i (blocks wholly before the window are not
    read); logit_softcap c: scores = c * tanh(scores / c) before the softmax (attention_ref)."""
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), context_lens.tolist()
    for b, ctx_len in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        first = window_start(ctx_len - (e - s), sliding_window, kv_cache.shape[2])
        k, v = gather_kv(kv_cache, block_tables[b], ctx_len, k_scale, v_scale, q.dtype, first)
        pos = torch.arange(ctx_len - (e - s), ctx_len, device=q.device)
        o = attention_ref(q[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], pos,
                          torch.arange(first, ctx_len, device=q.device), scale, sliding_window, logit_softcap)
        out[s:e] = o[0].transpose(0, 1)
    return out if out_scale is None else quantize_fp8_ref(out, out_scale)


def paged_decode_ref(q, kv_cache, block_tables, context_lens, scale, k_scale, v_scale,
                     num_splits: int | None = None, out_scale=None, sliding_window=None,
                     logit_softcap=None) -> torch.Tensor:
    """q [B, Hq, D], one new token per sequence (its K/V already stored) -> [B, Hq, D]."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_ref(q, kv_cache, qsl, context_lens, block_tables, 1, scale, k_scale, v_scale, out_scale,
                             sliding_window, logit_softcap)


# ---- KV store
@kernel
def _store_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, ks_ptr, vs_ptr, k_stride, v_stride, half_stride,
                     HKD: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """Program t: token t's K and V rows [HKD] to its slot; an FP8 cache gets V transposed within the block."""
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < HKD
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    dst = kv_ptr + slot * HKD + offs
    v_dst = dst + half_stride
    if FP8:
        v_dst = kv_ptr + half_stride + _v_offset(slot, offs, HKD, BS)
        k = tl.div_rn(k.to(tl.float32), tl.load(ks_ptr))
        v = tl.div_rn(v.to(tl.float32), tl.load(vs_ptr))
        k = tl.minimum(tl.maximum(k, -448.0), 448.0).to(tl.float8e4nv)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(kv_ptr.dtype.element_ty), mask=mask)


@helper
def _v_offset(slot, hd, HKD, BS: tl.constexpr):
    """Offset within the V half of element hd (= head * D + dim) of the token in `slot`, V transposed per block."""
    return slot // BS * (BS * HKD) + hd * BS + slot % BS


def store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale) -> None:
    """Triton: same contract as store_kv_ref. k, v [T, Hk, D] with contiguous heads (row stride free)."""
    t, hk, d = k.shape
    if k.stride(1) != d or k.stride(2) != 1 or v.stride(1) != d or v.stride(2) != 1:
        raise ValueError("store_kv needs k, v with contiguous [Hk, D] rows")
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    ks, vs = (_scale_tensor(k_scale, k.device), _scale_tensor(v_scale, k.device)) if fp8 else (k, v)
    _store_kv_kernel[(t,)](k, v, kv_cache, slot_mapping, ks, vs, k.stride(0), v.stride(0), kv_cache.stride(0),
                           HKD=hk * d, BS=kv_cache.shape[2], BLOCK=next_pow2(hk * d), FP8=fp8, num_warps=4)


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _scale_tensor(s, device):
    if isinstance(s, torch.Tensor):
        return s.to(device=device, dtype=torch.float32).reshape(1)
    return torch.tensor([float(s)], dtype=torch.float32, device=device)



# ---- attention: one tile of cached keys at a time, online softmax in fp32 (log2 domain)
@helper
def _output(o, os_ptr, model_dtype: tl.constexpr, QUANT_OUT: tl.constexpr):
    """The attention output as stored: rounded to the model dtype, then (QUANT_OUT) FP8 of that / out_scale."""
    o = o.to(model_dtype)
    if QUANT_OUT:
        v = tl.div_rn(o.to(tl.float32), tl.load(os_ptr))
        o = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)
    return o



@helper
def _kv_tile(kv_ptr, bt_ptr, bt_row, offs_n, mask_n, kvh, offs_d, half_stride, HKD: tl.constexpr, D: tl.constexpr,
             BS: tl.constexpr, V_T: tl.constexpr = False):
    """-> K, V tiles [BLOCK_N, D] of tokens offs_n, gathered through the block table row, in the stored dtype.
    V_T: V as stored transposed per block, [D, BLOCK_N] (byte loads: _kv_blocks reads it 16 tokens at a time)."""
    blk = tl.load(bt_ptr + bt_row + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
    ptrs = kv_ptr + (blk * BS + offs_n % BS)[:, None] * HKD + kvh * D + offs_d[None, :]
    k = tl.load(ptrs, mask=mask_n[:, None], other=0.0)
    if V_T:
        cols = blk * (BS * HKD) + kvh * (D * BS) + offs_n % BS
        v = tl.load(kv_ptr + half_stride + cols[None, :] + (offs_d * BS)[:, None], mask=mask_n[None, :], other=0.0)
    else:
        v = tl.load(ptrs + half_stride, mask=mask_n[:, None], other=0.0)
    return k, v


@helper
def _online_softmax(s, m, l):
    """Scores s [M, N] (log2 domain), running max m [M] and sum l [M] -> new m, alpha [M] (the factor on what was
    accumulated so far), P = 2^(s - m) [M, N], new l."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, 1)


@helper
def _softmax_step(q, k, v, valid, m, l, acc, qk_scale, v_scale, MASKED: tl.constexpr, V_T: tl.constexpr,
                  DOT_ACC: tl.constexpr = False, softcap=1.0, SOFTCAP: tl.constexpr = False):
    """q [M, D], k [N, D], v [N, D] (V_T: [D, N]), valid [M, N] (if MASKED) -> updated running max m [M], sum l [M],
    acc [M, D] (fp32). DOT_ACC: P.V accumulates inside the dot (acc * alpha is its accumulator) and acc leaves out
    V's scale, for the caller to apply once at the end. SOFTCAP: scores (log2 domain) become
    softcap * tanh(scores / softcap), softcap = c * log2(e) for a cap c on the natural-log scores."""
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m, alpha, p, l = _online_softmax(s, m, l)
    if DOT_ACC:
        acc = _pv(p.to(q.dtype), v.to(q.dtype), V_T, acc * alpha[:, None])
    else:
        acc = acc * alpha[:, None] + _pv(p.to(q.dtype), v.to(q.dtype), V_T) * v_scale
    return m, l, acc


@helper
def _tanh(x):
    """tanh in fp32 from exp2 (no libdevice call, so the interpreter runs it): +-1 once exp2 saturates."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2.885... = 2 * log2(e)


@helper
def _window_start(ctx_len, window, WINDOW: tl.constexpr, BS: tl.constexpr):
    """First key a decode query (at position ctx_len - 1) reads: 0, or with WINDOW the start of the cache block
    holding position ctx_len - window (blocks wholly before it are never loaded)."""
    if WINDOW:
        return tl.maximum(ctx_len - window, 0) // BS * BS
    return 0


@helper
def _pv(p, v, V_T: tl.constexpr, acc=None):
    """P [M, N] . V, with v [N, D] or (V_T) [D, N]; acc: the dot's accumulator."""
    if V_T:
        v = tl.trans(v)
    return tl.dot(p, v, acc)


@helper
def _block_ids(bt_ptr, bt_row, n0, last, BS: tl.constexpr, NB: tl.constexpr):
    """Block-table entries of the NB cache blocks from token n0 (a multiple of BS) on; blocks past token `last`'s are
    clamped to its block, so the load needs no mask."""
    return tl.load(bt_ptr + bt_row + tl.minimum(n0 // BS + tl.arange(0, NB), last // BS))


@helper
def _kv_blocks(ptr, blk, n0, last, kvh, half, HKDW: tl.constexpr, W: tl.constexpr, BS: tl.constexpr,
               NB: tl.constexpr, V_T: tl.constexpr = False):
    """K, V tiles [NB * BS, W] of tokens n0.. read through their NB block ids (_block_ids): 64-bit address math once
    per block, 32-bit within it; rows past token `last` re-read its row (finite, and masked out of the softmax), so
    the loads need no mask. W, HKDW: a row's and a token's width in elements of ptr. V_T: V as stored transposed,
    [W, NB * BS] (_vt_blocks)."""
    offs_r = tl.arange(0, BS)
    tok = tl.minimum((n0 + tl.arange(0, NB) * BS)[:, None] + offs_r[None, :], last)
    rows = (tok % BS) * HKDW + kvh * W
    ptrs = ptr + (blk.to(tl.int64) * (BS * HKDW))[:, None, None] + rows[:, :, None] + tl.arange(0, W)[None, None, :]
    k = tl.reshape(tl.load(ptrs), [NB * BS, W])
    if V_T:
        v = _vt_blocks(ptr + half, blk, kvh, HKDW, W, BS, NB)
    else:
        v = tl.reshape(tl.load(ptrs + half), [NB * BS, W])
    return k, v


@helper
def _vt_blocks(v_ptr, blk, kvh, HKD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr):
    """V^T tile [D, NB * BS] of the NB cache blocks `blk` (_block_ids) from a V half stored transposed per block
    ([blocks, Hk, D, BS]). Whole blocks: columns past the context read the rest of its last block, which must be
    finite (P is 0 there): the pool starts zeroed and every store is clamped to +-448."""
    cols = kvh * (D * BS) + tl.arange(0, BS)
    ptrs = (v_ptr + (blk.to(tl.int64) * (HKD * BS))[None, :, None] + cols[None, None, :]
            + (tl.arange(0, D) * BS)[:, None, None])
    return tl.reshape(tl.load(ptrs), [D, NB * BS])


@kernel
def _decode_kernel(q_ptr, kv_ptr, bt_ptr, ctx_ptr, ks_ptr, vs_ptr, os_ptr, out_ptr, part_ptr, lse_ptr, cnt_ptr,
                   qk_scale, bt_stride, half_stride, num_splits, window, softcap,
                   HQ: tl.constexpr, HKD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   BS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, DIRECT: tl.constexpr,
                   QUANT_OUT: tl.constexpr, BLOCKS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                   COMBINE: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """Program (b, kv head, split): the G query heads of one KV head over one slice of the context (_chunk).
    BLOCKS: tiles gathered block by block (DecodeVariant.blocks), else row by row.
    WINDOW: only keys from position ctx_len - window on are visible; the splits share the keys from the start of
    that key's cache block (_window_start) to the end, so earlier blocks are never loaded. SOFTCAP: _softmax_step's.
    COMBINE (splits only): the last split of a (b, kv head) to arrive (cnt_ptr: one arrival counter per pair, zero
    again after every launch) merges the splits' partials as _combine_kernel does, in the same launch.
    The context length, the first tile's block ids and the KV scales are loaded before the PDL wait: no kernel of a
    step writes them (they are uploaded before it), so under PDL these loads overlap the kernel before; q and the
    K / V rows (the new token's among them) wait. An idle split returns before it."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_ptr + b)
    lo = _window_start(ctx_len, window, WINDOW, BS)
    if DIRECT:  # one split
        start = lo
        end = ctx_len
    else:
        chunk = _chunk(ctx_len - lo, num_splits, BLOCK_N)
        start = lo + split * chunk
        if split > 0 and start >= ctx_len:  # an idle split: the combine reads only the first cdiv(span, chunk)
            return
        end = tl.minimum(start + chunk, ctx_len)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    heads = kvh * G + offs_g
    mask_g = offs_g < G
    k_scale, v_scale = 1.0, 1.0
    if FP8:
        k_scale, v_scale = tl.load(ks_ptr), tl.load(vs_ptr)
    bt_row = b * bt_stride
    if BLOCKS:
        NB: tl.constexpr = BLOCK_N // BS
        last = tl.maximum(end - 1, 0)
        blk = _block_ids(bt_ptr, bt_row, start, last, BS, NB)
    wait_for_producers(PDL)
    q = tl.load(q_ptr + (b * HQ + heads)[:, None] * D + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    if FP8:  # FP8 K/V become fp16 (exact; a native conversion on Hopper), so q and P run in fp16
        q = q.to(tl.float16)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    if BLOCKS:
        for n0 in range(start, end, BLOCK_N):
            k, v = _kv_blocks(kv_ptr, blk, n0, last, kvh, half_stride, HKD, D, BS, NB, FP8)
            blk = _block_ids(bt_ptr, bt_row, n0 + BLOCK_N, last, BS, NB)  # loads during this tile's math
            valid = n0 + tl.arange(0, BLOCK_N) < end
            if WINDOW:  # the first block may start before the window
                valid = valid & (n0 + tl.arange(0, BLOCK_N) >= ctx_len - window)
            m, l, acc = _softmax_step(q, k, v, valid[None, :], m, l, acc, qk_scale * k_scale, v_scale, True, FP8,
                                      False, softcap, SOFTCAP)
    else:
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if WINDOW:  # rows before the window are not loaded
                mask_n = mask_n & (offs_n >= ctx_len - window)
            k, v = _kv_tile(kv_ptr, bt_ptr, bt_row, offs_n, mask_n, kvh, offs_d, half_stride, HKD, D, BS)
            m, l, acc = _softmax_step(q, k, v, mask_n[None, :], m, l, acc, qk_scale * k_scale, v_scale,
                                      True, False, False, softcap, SOFTCAP)  # bf16 KV only (FP8 needs BLOCKS)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + (b * HQ + heads)[:, None] * D + offs_d[None, :],
                 _output(o, os_ptr, q_ptr.dtype.element_ty, QUANT_OUT), mask=mask_g[:, None])
    else:
        row = (b * HQ + heads) * num_splits + split  # partials [B, HQ, S, D], lse [B, HQ, S] (log2)
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], o, mask=mask_g[:, None])
        tl.store(lse_ptr + row, tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf")), mask=mask_g)
        if COMBINE:
            tl.debug_barrier()  # every thread's partial is stored before the (release) arrival below
            ran = tl.maximum(tl.cdiv(ctx_len - lo, chunk), 1)  # the splits that did not return idle
            arrived = tl.atomic_add(cnt_ptr + b * (HKD // D) + kvh, 1, sem="acq_rel", scope="gpu")
            if arrived == ran - 1:
                _combine_group(part_ptr, lse_ptr, os_ptr, out_ptr, (b * HQ + heads) * num_splits, b * HQ + heads,
                               mask_g, ran, q_ptr.dtype.element_ty, QUANT_OUT, GP, D, SP)
                tl.store(cnt_ptr + b * (HKD // D) + kvh, 0)  # every split has arrived: zero for the next launch


@helper
def _combine_group(part_ptr, lse_ptr, os_ptr, out_ptr, rows, out_rows, mask_g, ran, model_dtype: tl.constexpr,
                   QUANT_OUT: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
    """The GP heads' (rows: their first partial's row, [GP]) `ran` partials merged by their log-sum-exp, in split
    order, into out rows out_rows. Read from L2 (.cg): other SMs wrote them."""
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    lse = tl.load(lse_ptr + rows[:, None] + offs_s[None, :], mask=mask_g[:, None] & (offs_s < ran)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    lse_max = tl.where(mask_g, tl.max(lse, 1), 0.0)  # padding heads: finite, their rows are not stored
    w_sum = tl.where(mask_g, tl.sum(tl.exp2(lse - lse_max[:, None]), 1), 1.0)
    o = tl.zeros([GP, D], tl.float32)
    for s in range(0, ran):
        w = tl.exp2(tl.load(lse_ptr + rows + s, mask=mask_g, other=float("-inf"), cache_modifier=".cg") - lse_max)
        part = tl.load(part_ptr + (rows + s)[:, None] * D + offs_d[None, :], mask=mask_g[:, None], other=0.0,
                       cache_modifier=".cg")
        o += part * w[:, None]
    o = o / w_sum[:, None]
    tl.store(out_ptr + out_rows[:, None] * D + offs_d[None, :], _output(o, os_ptr, model_dtype, QUANT_OUT),
             mask=mask_g[:, None])


@helper
def _chunk(ctx_len, num_splits, BLOCK_N: tl.constexpr):
    """Context tokens per split: ctx_len over num_splits, rounded up to whole tiles. Splits from cdiv(ctx_len,
    chunk) on are idle (split 0 never is): a short context uses few of the splits launched."""
    return tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N


@kernel
def _combine_kernel(part_ptr, lse_ptr, ctx_ptr, os_ptr, out_ptr, num_splits, window, HQ: tl.constexpr,
                    D: tl.constexpr, SP: tl.constexpr, BLOCK_N: tl.constexpr, COMBINE_ROWS: tl.constexpr,
                    model_dtype: tl.constexpr, QUANT_OUT: tl.constexpr, WINDOW: tl.constexpr, BS: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (b * HQ + h): merges the partial outputs of the splits that ran, by their log-sum-exp. The context
    length is loaded before the PDL wait (as the decode kernel's), the partials after it. WINDOW, BS: the decode
    kernel's (the splits shared the keys from _window_start on)."""
    row = tl.program_id(0).to(tl.int64)
    ctx_len = tl.load(ctx_ptr + row // HQ)
    span = ctx_len - _window_start(ctx_len, window, WINDOW, BS)
    ran = tl.maximum(tl.cdiv(span, _chunk(span, num_splits, BLOCK_N)), 1)
    wait_for_producers(PDL)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=offs_s < ran, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    w_sum = tl.sum(tl.exp2(lse - lse_max), 0)
    o = tl.zeros([D], tl.float32)
    for s0 in range(0, ran, COMBINE_ROWS):  # partials COMBINE_ROWS splits at a time: [COMBINE_ROWS, D] in registers
        offs_r = s0 + tl.arange(0, COMBINE_ROWS)
        mask_r = offs_r < ran
        w = tl.exp2(tl.load(lse_ptr + row * num_splits + offs_r, mask=mask_r, other=float("-inf")) - lse_max)
        part = tl.load(part_ptr + (row * num_splits + offs_r)[:, None] * D + offs_d[None, :], mask=mask_r[:, None],
                       other=0.0)
        o += tl.sum(part * w[:, None], 0)
    o = o / w_sum
    tl.store(out_ptr + row * D + offs_d, _output(o, os_ptr, model_dtype, QUANT_OUT))


LOG2E = 1.4426950408889634
_COUNTERS: dict = {}  # device -> [int32 counters, zero between launches; the smaller ones graphs may still point at]


def _counters(device, n: int) -> torch.Tensor | None:
    """At least n zeroed arrival counters on device, or None while a CUDA graph is captured and there are too few
    (zeroed memory taken then would belong to the graph's pool): that launch combines in its own kernel."""
    kept = _COUNTERS.setdefault(device, [])
    if kept and kept[-1].numel() >= n:
        return kept[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    kept.append(torch.zeros(next_pow2(max(n, 1024)), dtype=torch.int32, device=device))
    return kept[-1]


def long_context(batch: int) -> int:
    """Keys past which a batch of this many sequences takes decode_splits' long-context split count."""
    return next(keys for max_batch, keys in tuning.current().decode_long_context if max_batch is None or
                batch <= max_batch)


def decode_splits(batch: int, num_kv_heads: int, max_context: int = 0) -> int:
    """Context splits per (sequence, KV head): enough programs to fill the GPU; more of them for a small batch with
    a context over long_context(batch) (max_context: the longest in the batch). CUDA graphs key on the result."""
    t = tuning.current()
    splits = max(1, min(t.decode_max_splits, cdiv(t.decode_target_programs, batch * num_kv_heads)))
    if max_context <= long_context(batch) or splits == 1:
        return splits
    return min(t.decode_max_splits_long, cdiv(t.decode_target_programs_long, batch * num_kv_heads))


def block_gather_fits(block_n: int, block_size: int) -> bool:
    """The block-wise gather (_kv_blocks) needs whole cache blocks per tile and a power-of-two block size."""
    return block_n % block_size == 0 and block_size & (block_size - 1) == 0


def paged_decode(q, kv_cache, block_tables, context_lens, scale, k_scale, v_scale,
                 num_splits: int | None = None, out_scale=None, variant: DecodeVariant | None = None,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
    """Triton: same contract as paged_decode_ref. No host sync (graph-capturable).
    num_splits: context splits launched (default decode_splits); a sequence uses those its context fills (_chunk).
    variant: run this DecodeVariant instead of decode_variant's choice (benchmarks, tests).
    sliding_window, logit_softcap: constexpr switches (None compiles the kernel without them)."""
    bsz, hq, d = q.shape
    _, _, bs, hk, _ = kv_cache.shape
    g = hq // hk
    s = num_splits or decode_splits(bsz, hk)
    q = q.contiguous()
    out = torch.empty_like(q, dtype=q.dtype if out_scale is None else torch.float8_e4m3fn)
    os_ = _scale_tensor(out_scale, q.device) if out_scale is not None else q
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    ks, vs = (_scale_tensor(k_scale, q.device), _scale_tensor(v_scale, q.device)) if fp8 else (q, q)
    cfg = variant or decode_variant(bsz, hk, fp8)
    if fp8 and cfg.blocks and cfg.block_n < bs:  # a tile holds whole cache blocks
        cfg = cfg._replace(block_n=bs)
    blocks = cfg.blocks and block_gather_fits(cfg.block_n, bs)
    if fp8 and not blocks:
        raise ValueError(f"FP8 KV decode reads V block by block: needs a blocks variant whose block_n is a multiple "
                         f"of the cache's block_size {bs} (a power of two); got {cfg}")
    part = torch.empty(bsz, hq, s, d, dtype=torch.float32, device=q.device) if s > 1 else out
    lse = torch.empty(bsz, hq, s, dtype=torch.float32, device=q.device) if s > 1 else out
    t = tuning.current()
    sp = t.decode_max_splits if s <= t.decode_max_splits else next_pow2(max(s, t.decode_max_splits_long))  # two
    # variants, both built by the decode graphs' warm-ups (an eager mixed step with another split count compiles
    # nothing mid-run)
    counters = _counters(q.device, bsz * hk) if s > 1 and bsz * hk <= t.decode_fused_combine_max_pairs else None
    _decode_kernel[(bsz, hk, s)](q, kv_cache, block_tables, context_lens, ks, vs, os_, out, part, lse,
                                 out if counters is None else counters, scale * LOG2E,
                                 block_tables.stride(0), kv_cache.stride(0), s, sliding_window or 0,
                                 (logit_softcap or 1.0) * LOG2E, HQ=hq, HKD=hk * d, G=g,
                                 GP=max(16, next_pow2(g)), D=d, BS=bs, BLOCK_N=cfg.block_n, FP8=fp8,
                                 DIRECT=s == 1, QUANT_OUT=out_scale is not None,
                                 BLOCKS=blocks, WINDOW=sliding_window is not None,
                                 SOFTCAP=logit_softcap is not None, COMBINE=counters is not None, SP=sp,
                                 num_warps=cfg.warps, num_stages=cfg.stages,
                                 **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    if s > 1 and counters is None:
        _combine_kernel[(bsz * hq,)](part, lse, context_lens, os_, out, s, sliding_window or 0, HQ=hq, D=d, SP=sp,
                                     BLOCK_N=cfg.block_n, COMBINE_ROWS=min(t.decode_combine_rows, sp),
                                     model_dtype=_tl_dtype(q.dtype), QUANT_OUT=out_scale is not None,
                                     WINDOW=sliding_window is not None, BS=bs, num_warps=4 if sp <= 16 else 8)
    return out
