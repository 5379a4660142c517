"""FP8 (and INT8) GEMM for small M (decode): out[M, N] = (x_q @ w_q^T) * scale_a * scale_b (+ bias), one launch.

x_q [M, K] and w_q [N, K] float8_e4m3fn (or both int8: int8_small_m_gemm, SmoothQuant's layers at 3-32 rows; int8
wgmma, exact int32 sums per program, fp32 from there on), both K-contiguous (w is the layout torch._scaled_mm takes
for prefill);
scale_a fp32 [] (static per tensor) or [M, 1] (dynamic per token); scale_b fp32 [] or [N] / [N, 1] (per output row:
merged q/k/v, gate/up, or per-channel checkpoints); bias [N] or None; fp32 accumulator; M <= 32.
Accuracy: tl.dot's Hopper default for fp8 (max_num_imprecise_acc 2**30) lets wgmma accumulate all of K at its reduced
internal precision: rel. error vs the fp32 reference up to 2.8e-3 on the H200 (the cuBLAS routes: 0.7e-3), enough to
move the engine's FP8 greedy picks past the end-to-end check's tie bar. So the dot promotes
to fp32 every PROMOTE_K elements of K (tl.dot's max_num_imprecise_acc; one fp8 wgmma is 32 wide), as cuBLAS's
default (non fast-accum) mode does.

Swap-AB on the tensor cores: out^T[BLOCK_N, M_PAD] = W[BLOCK_N, BK] @ x^T[BK, M_PAD] per K step (fp8 wgmma, the
weight tile is the 64-row side; M_PAD = 16 or 32), num_stages weight tiles in flight. Rows m >= M of x are not
loaded (zeros) and their columns are never stored.

Work is split in units (N tile, K step of BLOCK_K) and each program takes an equal run of consecutive units (so the
launch fills the SMs whatever the number of N tiles, "stream-K"): one or more tile segments. A tile owned by one
program is written directly; a tile shared by several programs is finished in the same launch: each writes its fp32
partial into a per-device workspace [parts, M, N] and increments the tile's arrival counter; the last to arrive sums
the parts in order 0, 1, ... (deterministic), applies the epilogue (scales, bias, one rounding) and resets the
counter to 0, so the counters are zero at every launch (CUDA graphs replay it as is). Launches on one stream
serialize, so one workspace per device serves every layer.
"""
import torch

from lowbit.kernels import tuning
from lowbit.kernels.linear import scratch
from lowbit.kernels._triton import cdiv, helper, kernel, next_pow2, tl, use_triton, wait_for_producers

MAX_M = 32
PROMOTE_K = 32  # K elements the tensor core sums at its reduced precision before adding into fp32 (module docstring)
COUNTER_SLOTS = 65536  # N tiles per launch (N <= 65536 * BLOCK_N)



@helper
def _epilogue_store(acc, out_ptr, sa_ptr, sb_ptr, bias_ptr, offs_n, offs_m, M, N,
                    SA_PER_ROW: tl.constexpr, SB_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, M_PAD] fp32 -> out[m, n] = acc * sa * sb (+ bias), rounded once, for m < M, n < N."""
    n_ok = offs_n < N
    m_ok = offs_m < M
    if SA_PER_ROW:
        acc = acc * tl.load(sa_ptr + offs_m, mask=m_ok, other=0.0)[None, :]
    else:
        acc = acc * tl.load(sa_ptr)
    if SB_PER_ROW:
        acc = acc * tl.load(sb_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    else:
        acc = acc * tl.load(sb_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@helper
def _sum_partials(ws_ptr, offs_n, offs_m, M, N, parts, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr):
    """sum over p < parts of workspace[p, m, n] in order p = 0, 1, ... (deterministic), [BLOCK_N, M_PAD] fp32.
    Read from L2 (.cg): other SMs wrote it."""
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
    total = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    for p in range(parts):
        total += tl.load(ptrs + p * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@helper
def _tile_partial(x_ptr, w_ptr, M, N, K, tile, s_begin, s_end, EVEN_K: tl.constexpr, DOT_FP16: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, PROMOTE_K: tl.constexpr):
    """[BLOCK_N, M_PAD] fp32 = sum over K steps s_begin <= s < s_end of W[tile rows, step s] @ x^T[step s]."""
    IS_INT8: tl.constexpr = x_ptr.dtype.element_ty == tl.int8
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M  # rows m >= M are not loaded (zeros), their columns are never stored
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: weight loads need no mask on N, stores are masked
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    k0 = s_begin * BLOCK_K
    w_ptrs = w_ptr + w_rows[:, None] * K + (k0 + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + x_rows[None, :] * K + (k0 + offs_k)[:, None]  # [BLOCK_K, M_PAD] = x^T tile
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.int32 if IS_INT8 and not DOT_FP16 else tl.float32)
    for step in range(s_begin, s_end):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_left = K - step * BLOCK_K
            w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if DOT_FP16:  # interpreter tests of the same code path; fp8 / int8 -> fp16 is exact
            acc = tl.dot(w.to(tl.float16), xt.to(tl.float16), acc)
        elif IS_INT8:
            acc = tl.dot(w, xt, acc, out_dtype=tl.int32)  # int8 wgmma: exact int32 sums (|sum| < 127^2 K)
        else:
            acc = tl.dot(w, xt, acc, max_num_imprecise_acc=PROMOTE_K)  # fp32 promotion every PROMOTE_K of K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc.to(tl.float32)


@helper
def _finish_shared_tile(acc, slot, parts, tile, ws_ptr, cnt_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N,
                        SA_PER_ROW: tl.constexpr, SB_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, M_PAD: tl.constexpr):
    """One of `parts` programs sharing a tile: store the partial in workspace slot `slot` ([parts, M, N] fp32);
    the last to arrive sums all parts, writes the output and resets the tile's counter to 0."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    part_ptrs = ws_ptr + (slot * M + offs_m[None, :]) * N + offs_n[:, None]
    tl.store(part_ptrs, acc, mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    tl.debug_barrier()  # every thread's partial is stored before the (release) arrival below
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == parts - 1:
        total = _sum_partials(ws_ptr, offs_n, offs_m, M, N, parts, BLOCK_N, M_PAD)
        _epilogue_store(total, out_ptr, sa_ptr, sb_ptr, bias_ptr, offs_n, offs_m, M, N,
                        SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
        tl.store(cnt_ptr + tile, 0)  # every part of this tile has arrived: zero again for the next launch


@kernel
def _fp8_small_m_kernel(x_ptr, w_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K,
                        n_tiles, steps_per_tile, units_per_program,
                        SA_PER_ROW: tl.constexpr, SB_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_FP16: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, PROMOTE_K: tl.constexpr,
                        PDL: tl.constexpr):
    # work unit u = tile * steps_per_tile + K step; program p owns units [p * U, (p + 1) * U) (U units_per_program),
    # i.e. one or more tile segments; a tile split between programs is finished by the last of them to arrive
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    u_begin = pid * units_per_program
    u_end = tl.minimum(u_begin + units_per_program, n_tiles * steps_per_tile)
    first_tile = u_begin // steps_per_tile
    n_segments = (u_end - 1) // steps_per_tile - first_tile + 1
    for seg in range(n_segments):
        tile = first_tile + seg
        s_begin = tl.maximum(u_begin - tile * steps_per_tile, 0)
        s_end = tl.minimum(u_end - tile * steps_per_tile, steps_per_tile)
        acc = _tile_partial(x_ptr, w_ptr, M, N, K, tile, s_begin, s_end, EVEN_K, DOT_FP16,
                            BLOCK_N, BLOCK_K, M_PAD, PROMOTE_K)
        owner_first = (tile * steps_per_tile) // units_per_program
        owner_last = ((tile + 1) * steps_per_tile - 1) // units_per_program
        if owner_first == owner_last:
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            _epilogue_store(acc, out_ptr, sa_ptr, sb_ptr, bias_ptr, offs_n, tl.arange(0, M_PAD), M, N,
                            SA_PER_ROW, SB_PER_ROW, HAS_BIAS)
        else:
            _finish_shared_tile(acc, pid - owner_first, owner_last - owner_first + 1, tile, ws_ptr, cnt_ptr,
                                out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, SA_PER_ROW, SB_PER_ROW, HAS_BIAS,
                                BLOCK_N, M_PAD)


# ---- workspace: the partials in a scratch buffer (lowbit.kernels.linear.scratch); the counters, once per device
_WORKSPACE: dict = {}  # device -> {"counters": int32 [COUNTER_SLOTS], zero between launches}


def _workspace(device, floats: int):
    """(partials fp32 >= floats, counters int32 [COUNTER_SLOTS]), or (None, None) while a CUDA graph is being
    captured and the partials are too small (scratch.grown)."""
    partials = scratch.grown("fp8_small_m partials", device, torch.float32, floats)
    if partials is None:
        return None, None
    ws = _WORKSPACE.get(device)
    if ws is None:  # created with the first partials, outside any capture
        ws = _WORKSPACE[device] = {"counters": torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)}
    return partials, ws["counters"]


# ---- configs
# (BLOCK_N, BLOCK_K, PROGRAMS, num_warps, num_stages); PROGRAMS 0 = one program per N tile (no shared tiles).
_SM_COUNT: dict = {}


def sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def choose_config(M: int, N: int, K: int, sms: int = 132):
    """The best of 48 configs per Llama-3.1-8B shape at M = 1 and 16 on the H200: 64 x 256 tiles, 4 warps; six
    weight tiles in flight (one program per SM) when the N tiles fit one wave, else four (two programs per SM); one
    program per N tile, except when under half the SMs would have a tile and each tile is long (>= 32 K steps): then
    the K steps are spread over all SMs (14336->4096)."""
    n_tiles, steps = cdiv(N, 64), cdiv(K, 256)
    stages = 6 if n_tiles <= sms else 4
    programs = sms if 2 * n_tiles <= sms and steps >= 32 else 0
    return 64, 256, programs, 4, stages


def split_work(N: int, K: int, block_n: int, block_k: int, programs: int):
    """-> (n_tiles, steps_per_tile, units_per_program, programs launched, parts per tile at most)."""
    n_tiles, steps = cdiv(N, block_n), cdiv(K, block_k)
    units = steps if programs <= 0 else cdiv(n_tiles * steps, programs)
    launched = cdiv(n_tiles * steps, units)
    max_parts = 1 if units % steps == 0 else cdiv(steps, units) + 1
    return n_tiles, steps, units, launched, max_parts


def fp8_small_m_gemm(q, w, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, config=None, dot_fp16=False):
    """q [M, K] fp8 (M <= MAX_M), w [N, K] fp8 -> [M, N] out_dtype. config = (BLOCK_N, BLOCK_K, PROGRAMS,
    num_warps, num_stages); dot_fp16 runs the dot on fp16 copies of the tiles (interpreter tests only)."""
    assert q.dtype == w.dtype == torch.float8_e4m3fn, (q.dtype, w.dtype)
    return _small_m_gemm(q, w, scale_a, scale_b, bias, out_dtype, config, dot_fp16)


def int8_small_m_gemm(q, w, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, config=None, dot_fp16=False):
    """fp8_small_m_gemm for int8 q [M, K] and w [N, K] (SmoothQuant: x ~= q * scale_a, W ~= w * scale_b)."""
    assert q.dtype == w.dtype == torch.int8, (q.dtype, w.dtype)
    return _small_m_gemm(q, w, scale_a, scale_b, bias, out_dtype, config, dot_fp16)


def _small_m_gemm(q, w, scale_a, scale_b, bias, out_dtype, config, dot_fp16):
    assert use_triton(q) and q.shape[0] <= MAX_M
    q = q.contiguous()
    M, K = q.shape
    N = w.shape[0]
    assert w.shape[1] == K and w.stride() == (K, 1), "w must be [N, K] row-major"
    scale_a, scale_b = scale_a.float().reshape(-1), scale_b.float().reshape(-1)
    block_n, block_k, programs, warps, stages = config or choose_config(M, N, K, sm_count(q.device))
    m_pad = max(16, next_pow2(M))
    smem = tuning.current().fp8_small_m_smem_bytes
    stages = max(1, min(stages, smem // (block_n * block_k + block_k * m_pad)))  # tiles in flight fit in smem
    n_tiles, steps, units, launched, max_parts = split_work(N, K, block_n, block_k, programs)
    partials, counters = scale_b, scale_b  # unused when no tile is shared
    if max_parts > 1:
        partials, counters = _workspace(q.device, max_parts * M * N)
        if partials is None:  # capturing with too small a workspace: one program per tile (correct, slower)
            n_tiles, steps, units, launched, max_parts = split_work(N, K, block_n, block_k, 0)
            partials, counters = scale_b, scale_b
    assert n_tiles <= COUNTER_SLOTS
    out = torch.empty(M, N, dtype=out_dtype, device=q.device)
    _fp8_small_m_kernel[(launched,)](
        q, w, out, scale_a, scale_b, bias if bias is not None else scale_b, partials, counters, M, N, K,
        n_tiles, steps, units,
        SA_PER_ROW=scale_a.numel() > 1, SB_PER_ROW=scale_b.numel() > 1, HAS_BIAS=bias is not None,
        EVEN_K=K % block_k == 0, DOT_FP16=dot_fp16,
        BLOCK_N=block_n, BLOCK_K=block_k, M_PAD=m_pad, PROMOTE_K=PROMOTE_K, num_warps=warps, num_stages=stages)
    return out
