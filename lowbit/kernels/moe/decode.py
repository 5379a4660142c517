"""The fused MoE's decode path for 16-bit and static-FP8 experts: two launches per layer, no SiLU or combine kernel.

- gate_up_silu: act[i] = silu(gate) * up of x[i // top_k] @ w13[ids[i]]^T for every (token, slot) pair i, [pairs, I]
  in x's dtype (the GEMV's outputs rounded to x's dtype first, as the GEMV then silu_and_mul).
- down_combine: out[t] = sum_j weights[t, j] * round(act[t * top_k + j] @ w2[ids[t, j]]^T) in fp32, rounded once (the
  per-pair GEMV then the combine). One program per (token, column block, slot), as many as the per-pair GEMV has; each
  stores its rounded row block in fp32 to a workspace and counts its arrival, and the last of a (token, column block)'s
  top_k programs to arrive sums them with the routing weights and resets the counter to 0 (so the counters are zero
  at every launch, and CUDA graphs replay it as is).

FP8 experts quantize x with their own static input scale, fp8(clamp(x / a_scale[e], +-448)), and scale the fp32 sum
by a_scale[e] * w_scale[e, n] (the grouped GEMM's epilogue). Per-token FP8 experts, and INT8 / INT4 / NVFP4 ones, take
lowbit.kernels.moe.gemv.

Layout as lowbit.kernels.linear.dense_gemv: a K step is C = BLOCK_K / VEC chunks of VEC = 16 bytes of elements per
row; a thread holds every row of its chunks (one 16-byte .cg load per row and chunk, one x load per chunk shared by
the rows), and the next step's weights load while this one is computed. down_combine loads its expert id and first
weights before the PDL wait (the router that wrote the ids finished before the kernel in between began).
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels.linear import scratch
from lowbit.kernels._triton import (cdiv, early_kernel, helper, kernel, load_streamed, next_pow2, tl, use_triton,
                                    wait_for_producers)

COUNTER_SLOTS = 65536  # (token, column block) pairs of one launch
_COUNTERS: dict = {}  # device -> int32 [COUNTER_SLOTS], zero between launches


def decode_config(projection: str, element_size: int, config: tuple | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of "gate_up" or "down" for weights of element_size bytes: config, else the
    Tuning's (BLOCK_N, step bytes, warps)."""
    block_n, step_bytes, warps = config or tuning.current().moe_decode_config[projection]
    return block_n, step_bytes // element_size, warps


def _check(x, w, ids, w_scale, a_scale):
    if x.stride(-1) != 1 or not w.is_contiguous():
        raise ValueError("moe decode: x needs unit stride along K and w must be contiguous")
    if (w_scale is None) != (a_scale is None):
        raise ValueError("moe decode: FP8 experts need both w_scale [E, N] and a_scale [E] (static input scales)")
    if w_scale is not None and (w.dtype != torch.float8_e4m3fn or tuple(w_scale.shape) != tuple(w.shape[:2])
                                or tuple(a_scale.shape) != (w.shape[0],)):
        raise ValueError(f"moe decode: FP8 needs float8_e4m3fn w [E, N, K], w_scale [E, N], a_scale [E]; got "
                         f"{w.dtype} {tuple(w.shape)}, {tuple(w_scale.shape)}, {tuple(a_scale.shape)}")
    if w_scale is None and w.dtype != x.dtype:
        raise ValueError(f"moe decode: 16-bit experts need x's dtype {x.dtype}, got {w.dtype}")
    fp8 = w_scale is not None
    scales = (w_scale.float().contiguous(), a_scale.float().contiguous()) if fp8 else (w, w)  # unused pointers
    return fp8, scales, ids.reshape(-1).contiguous()


def gate_up_silu(x, w13, ids, top_k: int, w_scale=None, a_scale=None, config=None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (x's dtype, or float8_e4m3fn with w_scale fp32 [E, 2I] and a_scale [E]), ids [T, top_k]
    -> silu(gate) * up per pair, [T * top_k, I] in x's dtype."""
    assert use_triton(x)
    fp8, (ws, a_s), flat = _check(x, w13, ids, w_scale, a_scale)
    n, kdim = w13.shape[1:]
    block_n, block_k, warps = decode_config("gate_up", w13.element_size(), config)
    vec = 16 // w13.element_size()
    assert block_k % (vec * 32 * warps) == 0 and n % 2 == 0, (block_k, warps, n)
    out = torch.empty(flat.numel(), n // 2, dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(flat.numel(), cdiv(n // 2, block_n // 2))](
        x, w13, flat, ws, a_s, out, n, kdim, x.stride(0), TOP_K=top_k, FP8=fp8, VEC=vec, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=kdim % block_k == 0, ONE_STEP=kdim <= block_k, num_warps=warps)
    return out


def down_combine(act, w2, ids, weights, w_scale=None, a_scale=None, config=None) -> torch.Tensor | None:
    """act [T * top_k, I] (pair order), w2 [E, H, I] (act's dtype, or FP8 as gate_up_silu's), ids / weights
    [T, top_k] -> sum_j weights[t, j] * round(act[t * top_k + j] @ w2[ids[t, j]]^T), [T, H] in act's dtype; None
    while a CUDA graph is captured and the workspace is too small (memory taken then would belong to the graph)."""
    assert use_triton(act)
    fp8, (ws, a_s), flat = _check(act, w2, ids, w_scale, a_scale)
    t, top_k = ids.shape
    n, kdim = w2.shape[1:]
    block_n, block_k, warps = decode_config("down", w2.element_size(), config)
    vec = 16 // w2.element_size()
    assert block_k % (vec * 32 * warps) == 0, (block_k, warps)
    if t * cdiv(n, block_n) > COUNTER_SLOTS:
        raise ValueError(f"moe decode: {t} tokens x {cdiv(n, block_n)} column blocks past {COUNTER_SLOTS} counters")
    partials, counters = _workspace(act.device, t * top_k * n)
    if partials is None:
        return None
    out = torch.empty(t, n, dtype=act.dtype, device=act.device)
    _down_combine_kernel[(t, cdiv(n, block_n), top_k)](
        act, w2, flat, weights.float().contiguous(), ws, a_s, partials, counters, out, n, kdim, act.stride(0),
        TOP_K=top_k, TOP_KP=next_pow2(top_k), FP8=fp8, VEC=vec, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=kdim % block_k == 0, ONE_STEP=kdim <= block_k, num_warps=warps)
    return out


def _workspace(device, floats: int):
    """(fp32 partials >= floats, int32 counters [COUNTER_SLOTS], zero), or (None, None) while a CUDA graph is being
    captured and either would have to be made."""
    partials = scratch.grown("moe decode partials", device, torch.float32, floats)
    if device not in _COUNTERS:
        if partials is None or device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None, None
        _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return partials, _COUNTERS[device]


@helper
def quantized_chunk(x_ptr, offs, mask, a_scale, FP8: tl.constexpr):
    """x at offs as fp32 (0 where not mask); FP8: its e4m3 fake quantization with the expert's input scale."""
    xs = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FP8:
        xs = tl.minimum(tl.maximum(tl.div_rn(xs, a_scale), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
    return xs


@helper
def rows_dot_x(w, w_ptrs, x_row, kk, K, a_scale, FP8: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_STEP: tl.constexpr):
    """[BLOCK_N] fp32 sums of the weight rows at w_ptrs ([C, BN, VEC], kk their K offsets [C, 1, VEC]; w: the first
    step, already loaded) times x_row (quantized_chunk's), the next step's weights loaded during this one's math."""
    acc = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    n_steps = tl.cdiv(K, BLOCK_K)
    for kb in range(0, n_steps):
        k0 = kb * BLOCK_K
        if not ONE_STEP:
            k_next = tl.minimum(kb + 1, n_steps - 1) * BLOCK_K  # the last step reloads itself
            w_next = load_streamed(w_ptrs + k_next, k_next + kk < K, not EVEN_K)
        xs = quantized_chunk(x_row, k0 + kk, k0 + kk < K, a_scale, FP8)
        acc += tl.sum(w.to(tl.float32) * xs, axis=2)
        if not ONE_STEP:
            w = w_next
    return tl.sum(acc, axis=0)


@kernel
def _gate_up_silu_kernel(x_ptr, w_ptr, ids_ptr, ws_ptr, as_ptr, out_ptr, N, K, stride_x, TOP_K: tl.constexpr,
                         FP8: tl.constexpr, VEC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr):
    """Program (pair, j): gate rows j * BLOCK_N / 2 + r and their up rows N / 2 later -> BLOCK_N / 2 outputs."""
    C: tl.constexpr = BLOCK_K // VEC
    HALF: tl.constexpr = BLOCK_N // 2
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * HALF + tl.arange(0, BLOCK_N) % HALF  # the output column of each row's pair
    n_rows = (tl.minimum(offs_n, N // 2 - 1) + (tl.arange(0, BLOCK_N) // HALF) * (N // 2)).to(tl.int64)
    kk = (VEC * tl.arange(0, C))[:, None, None] + tl.arange(0, VEC)[None, None, :]  # [C, 1, VEC]
    wait_for_producers(PDL)  # the ids come from the router just before
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_scale = 1.0
    if FP8:
        a_scale = tl.load(as_ptr + expert)
    w_ptrs = w_ptr + expert * N * K + n_rows[None, :, None] * K + kk  # [C, BN, VEC]
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    w = load_streamed(w_ptrs, kk < K, not EVEN_K)
    y = rows_dot_x(w, w_ptrs, x_row, kk, K, a_scale, FP8, C, BLOCK_N, BLOCK_K, EVEN_K, ONE_STEP)
    if FP8:
        y = y * a_scale * tl.load(ws_ptr + expert * N + n_rows)
    pair_rows = tl.reshape(y.to(out_ptr.dtype.element_ty).to(tl.float32), (2, HALF))  # [gate, up] x HALF
    half = tl.arange(0, 2)[:, None]
    gate = tl.sum(tl.where(half == 0, pair_rows, 0.0), axis=0)
    up = tl.sum(tl.where(half == 1, pair_rows, 0.0), axis=0)
    cols = tl.program_id(1) * HALF + tl.arange(0, HALF)
    tl.store(out_ptr + pair.to(tl.int64) * (N // 2) + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(
        out_ptr.dtype.element_ty), mask=cols < N // 2)


@early_kernel
def _down_combine_kernel(a_ptr, w_ptr, ids_ptr, wt_ptr, ws_ptr, as_ptr, part_ptr, cnt_ptr, out_ptr, N, K, stride_a,
                         TOP_K: tl.constexpr, TOP_KP: tl.constexpr, FP8: tl.constexpr, VEC: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_STEP: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (token t, column block j, slot s): columns j * BLOCK_N + r of pair t * TOP_K + s, rounded, into the
    partials [T * TOP_K, N] fp32; the last of the TOP_K slots of (t, j) to arrive writes out[t] there."""
    C: tl.constexpr = BLOCK_K // VEC
    tok = tl.program_id(0).to(tl.int64)
    pair = tok * TOP_K + tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    kk = (VEC * tl.arange(0, C))[:, None, None] + tl.arange(0, VEC)[None, None, :]  # [C, 1, VEC]
    expert = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int64)
    w_ptrs = w_ptr + expert * N * K + n_rows[None, :, None] * K + kk  # [C, BN, VEC]
    w = load_streamed(w_ptrs, kk < K, not EVEN_K)
    a_scale = 1.0
    if FP8:
        a_scale = tl.load(as_ptr + expert)
    wait_for_producers(PDL)
    y = rows_dot_x(w, w_ptrs, a_ptr + pair * stride_a, kk, K, a_scale, FP8, C, BLOCK_N, BLOCK_K, EVEN_K, ONE_STEP)
    if FP8:
        y = y * a_scale * tl.load(ws_ptr + expert * N + n_rows)
    col_ok = offs_n < N
    tl.store(part_ptr + pair * N + offs_n, y.to(out_ptr.dtype.element_ty).to(tl.float32), mask=col_ok)
    tl.debug_barrier()  # every thread's partial is stored before the (release) arrival below
    counter = cnt_ptr + tok * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
        slots = tl.arange(0, TOP_KP)
        rows = tl.load(part_ptr + (tok * TOP_K + slots)[:, None] * N + offs_n[None, :],
                       mask=(slots < TOP_K)[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
        wts = tl.load(wt_ptr + tok * TOP_K + slots, mask=slots < TOP_K, other=0.0)
        tl.store(out_ptr + tok * N + offs_n, tl.sum(rows * wts[:, None], axis=0).to(out_ptr.dtype.element_ty),
                 mask=col_ok)
        tl.store(counter, 0)  # every slot has arrived: zero again for the next launch
