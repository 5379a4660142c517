"""The MoE router's top-k: router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]), softmax in fp32
over all experts, the k largest in descending order, divided by their sum when renormalize (transformers'
norm_topk_prob; Mixtral always). On the GPU one small kernel per step in place of torch's softmax / topk / sum / div
chain; ties go to the lower expert id there (torch.topk leaves their order open).

moe_router is the router's linear (16-bit weight [E, H], no bias; logits rounded to x's dtype) and the top-k together;
at one token on the GPU (routes' op "moe_router") one launch: the GEMV's programs (lowbit.kernels.linear.dense_gemv's
layout) store the logits, and the last program to finish (an arrival counter, zero again after every launch) picks the
experts from them.
"""
import torch
import torch.nn.functional as F

from lowbit.kernels import routes
from lowbit.kernels._triton import (capability, cdiv, early_kernel, helper, kernel, load_streamed, next_pow2, on_gpu,
                                    tl, wait_for_producers)
from lowbit.kernels.moe.decode import rows_dot_x


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not on_gpu(logits):
        return moe_route_ref(logits, top_k, renormalize)
    return moe_route_triton(logits, top_k, renormalize)


def moe_router_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool):
    """-> (weights fp32 [T, k], ids int64 [T, k], logits [T, E] in x's dtype): fp32 math, logits rounded."""
    logits = F.linear(x.float(), weight.float()).to(x.dtype)
    return (*moe_route_ref(logits, top_k, renormalize), logits)


def moe_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool):
    """x [T, H], weight [E, H] -> moe_router_ref's (weights, ids, logits), as routes' op "moe_router" runs it."""
    x16 = x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    if on_gpu(x) and routes.route("moe_router", "dense", x.shape[0], weight.shape[0], weight.shape[1],
                                  capability(x.device), x16=x16) == "router_topk" and _counter(x.device) is not None:
        return router_topk(x, weight, top_k, renormalize)
    from lowbit.kernels.linear.dense_gemv import dense_linear
    logits = dense_linear(x, weight)
    return (*moe_route(logits, top_k, renormalize), logits)


_COUNTERS: dict = {}  # device -> int32 [1], zero between launches of router_topk


def _counter(device) -> torch.Tensor | None:
    """router_topk's arrival counter on device, zeroed; None while a CUDA graph is captured before it exists (zeroed
    memory taken then would belong to the graph's pool): the router then runs as its linear and the top-k kernel."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, config=None):
    """One token: x [1, H], weight [E, H] of x's dtype -> moe_router_ref's (weights, ids, logits) in one launch.
    config: dense_gemv's (BLOCK_N, BLOCK_K, num_warps), default its gemv_config(E)."""
    from lowbit.kernels.linear.dense_gemv import gemv_config

    e, h = weight.shape
    if x.shape != (1, h) or weight.dtype != x.dtype or not 0 < top_k <= e:
        raise ValueError(f"router_topk: one token [1, {h}] of the weight's dtype and top_k in 1..{e}; got "
                         f"{tuple(x.shape)} {x.dtype}, {weight.dtype}, top_k {top_k}")
    vec = 16 // weight.element_size()
    block_n, block_k, warps = config or gemv_config(e, weight.element_size())
    assert block_k % (vec * 32 * warps) == 0, (block_k, warps)
    counter = _counter(x.device)
    if counter is None:
        raise RuntimeError("router_topk: its first launch on a device must not be inside a CUDA graph capture")
    x, weight = x.contiguous(), weight.contiguous()
    logits = torch.empty(1, e, dtype=x.dtype, device=x.device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    _router_topk_kernel[(cdiv(e, block_n),)](
        x, weight, logits, counter, weights, ids, e, h, TOP_K=top_k, RENORM=renormalize, VEC=vec, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_E=next_pow2(e), BLOCK_TK=next_pow2(top_k), EVEN_K=h % block_k == 0,
        ONE_STEP=h <= block_k, num_warps=warps)
    return weights, ids, logits


def moe_route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel (also under the CPU interpreter): one program per token."""
    t, e = logits.shape
    if not 0 < top_k <= e or logits.stride(-1) != 1:
        raise ValueError(f"moe_route: top_k {top_k} of {e} experts, logits need unit stride along experts")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k, RENORM=renormalize,
                            BLOCK_E=next_pow2(e), BLOCK_K=next_pow2(top_k))
    return weights, ids


@helper
def _top_k(x, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Logits x fp32 [BLOCK_E] (-inf from E on) -> (weights fp32 [BLOCK_K], ids int32 [BLOCK_K]); slots past TOP_K
    hold 0."""
    experts = tl.arange(0, BLOCK_E)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(experts < E, p, -1.0)  # below every probability: never picked
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked_id = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, experts, BLOCK_E), axis=0)  # the lowest id among ties
        picked_w = tl.where(slots == j, best, picked_w)
        picked_id = tl.where(slots == j, idx, picked_id)
        p = tl.where(experts == idx, -1.0, p)
    if RENORM:
        picked_w = picked_w / tl.sum(picked_w, axis=0)
    return picked_w, picked_id


@kernel
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    tok = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + tok * stride_t + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    picked_w, picked_id = _top_k(x, E, TOP_K, RENORM, BLOCK_E, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    ok = slots < TOP_K
    tl.store(w_ptr + tok * TOP_K + slots, picked_w, mask=ok)
    tl.store(ids_ptr + tok * TOP_K + slots, picked_id.to(tl.int64), mask=ok)


@early_kernel
def _router_topk_kernel(x_ptr, w_ptr, logits_ptr, cnt_ptr, wout_ptr, ids_ptr, E, K, TOP_K: tl.constexpr,
                        RENORM: tl.constexpr, VEC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr, EVEN_K: tl.constexpr, ONE_STEP: tl.constexpr,
                        PDL: tl.constexpr):
    """Program j: logits of experts j * BLOCK_N + r; the last program to arrive: the top-k of all E."""
    C: tl.constexpr = BLOCK_K // VEC
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, E - 1).to(tl.int64)
    kk = (VEC * tl.arange(0, C))[:, None, None] + tl.arange(0, VEC)[None, None, :]  # [C, 1, VEC]
    w_ptrs = w_ptr + n_rows[None, :, None] * K + kk  # [C, BN, VEC]
    w = load_streamed(w_ptrs, kk < K, not EVEN_K)
    wait_for_producers(PDL)
    y = rows_dot_x(w, w_ptrs, x_ptr, kk, K, 1.0, False, C, BLOCK_N, BLOCK_K, EVEN_K, ONE_STEP)
    tl.store(logits_ptr + offs_n, y.to(logits_ptr.dtype.element_ty), mask=offs_n < E)
    tl.debug_barrier()  # every thread's logits are stored before the (release) arrival below
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        experts = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + experts, mask=experts < E, other=-float("inf"), cache_modifier=".cg")
        picked_w, picked_id = _top_k(x.to(tl.float32), E, TOP_K, RENORM, BLOCK_E, BLOCK_TK)
        slots = tl.arange(0, BLOCK_TK)
        tl.store(wout_ptr + slots, picked_w, mask=slots < TOP_K)
        tl.store(ids_ptr + slots, picked_id.to(tl.int64), mask=slots < TOP_K)
        tl.store(cnt_ptr, 0)  # every program has arrived: zero again for the next launch
