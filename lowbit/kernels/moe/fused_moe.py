"""The experts of a sparse MoE layer over all tokens: x [T, H] -> sum_j w[t, j] * down_e(silu(gate_e(x)) * up_e(x)),
e = topk_ids[t, j]; the Triton path is two grouped GEMMs (one launch per projection over every expert) and a combine.

Weights are stacked per projection: w13 [E, 2I, H] (gate rows then up rows of each expert, as transformers'
gate_up_proj), w2 [E, H, I]. Rounding (both paths): each GEMM accumulates in fp32 and stores x's dtype; silu(gate) * up
in fp32, stored in x's dtype; the combine sums the top_k weighted rows in fp32 and rounds once.

FP8 experts (`fp8=Fp8Scales(...)`): w13 / w2 are float8_e4m3fn and every expert e quantizes its own input rows with
its own static input scale, q = fp8(clamp(a / a_scale[e], +-448)), as a per-expert modelopt linear does (a shared
scale, e.g. the layer's largest, would round and clip differently wherever the experts' scales differ). The GEMM
dequantizes in its epilogue: acc * a_scale[e] * w_scale[e, n], with one weight scale per output row (a per-tensor
scale repeated, or gate's and up's when a merged gate/up carries two). Per-token FP8 experts (fp8_dynamic: a13_scale
and a2_scale None) quantize each input row with its own scale amax(|row|) / 448 (token_scales, computed once per
projection: an x row's scale is the same for every expert it reaches) and dequantize by it in the epilogue.

INT4 experts (`int4=Int4Scales(...)`): w13 / w2 are packed uint8 (lowbit.kernels.moe.int4 says how).
INT8 W8A8 experts (`int8=Int8Scales(...)`): w13 / w2 are int8, each expert's input smoothed and quantized with its own
pre_quant_scale and static input scale (lowbit.kernels.moe.int8 says how).
NVFP4 experts (`nvfp4=Nvfp4Scales(...)`): w13 / w2 are e2m1 codes, uint8 [E, 2I, H/2] / [E, H, I/2], weight-only
(lowbit.kernels.moe.nvfp4 says how).

Which kernels run is routes' op "moe" (by the number of (token, slot) pairs): the grouped GEMMs above, or at a few
pairs the per-pair GEMVs of lowbit.kernels.moe.gemv; both feed the same SiLU-and-mul and combine. 16-bit and static-FP8
experts at a few pairs take lowbit.kernels.moe.decode instead: those two steps fused into the GEMVs.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lowbit.formats.numerics import fake_quant_fp8, fake_quant_fp8_per_token

from lowbit.kernels import routes
from lowbit.kernels._triton import cdiv, kernel, next_pow2, on_gpu, tl, wait_for_producers
from lowbit.kernels.moe.align import block_rows, moe_align
from lowbit.kernels.moe.decode import down_combine, gate_up_silu
from lowbit.kernels.moe.gemv import expert_gemv, expert_gemv_int4, expert_gemv_int8, token_scales
from lowbit.kernels.moe.int4 import Int4Scales, grouped_gemm_int4, int4_linear_ref
from lowbit.kernels.moe.int8 import Int8Scales, grouped_gemm_int8, int8_linear_ref
from lowbit.kernels.moe.nvfp4 import Nvfp4Scales, expert_gemv_nvfp4, grouped_gemm_nvfp4, nvfp4_linear_ref
from lowbit.kernels.ops.activation import silu_and_mul_ref

BLOCK_M = 16  # rows of one expert per GEMM tile; an expert's run is padded to it
BLOCK_N = 64
BLOCK_K = 64


class Fp8Scales(NamedTuple):
    """Scales of FP8 experts, all float32 on the weights' device: w13_scale [E, 2I] and w2_scale [E, H] (one per
    output row of each expert's weight), a13_scale [E] and a2_scale [E] (each expert's static input scale), or both
    None: activations quantized per token."""
    w13_scale: torch.Tensor
    a13_scale: torch.Tensor
    w2_scale: torch.Tensor
    a2_scale: torch.Tensor


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, fp8: Fp8Scales | None = None, int4: Int4Scales | None = None,
              nvfp4: Nvfp4Scales | None = None, int8: Int8Scales | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (x's dtype, float8_e4m3fn with fp8, int8 with int8, packed uint8
    [E, I, H] / [E, H/2, I] with int4, uint8 [E, 2I, H/2] / [E, H, I/2] with nvfp4), topk_ids [T, k] int,
    topk_weights [T, k] float -> [T, H]."""
    run = fused_moe_triton if on_gpu(x) else fused_moe_ref
    return run(x, w13, w2, topk_ids, topk_weights, fp8=fp8, int4=int4, nvfp4=nvfp4, int8=int8)


def expert_kind(fp8: Fp8Scales | None, int4: Int4Scales | None, nvfp4: Nvfp4Scales | None = None,
                int8: Int8Scales | None = None) -> str:
    """The experts' weight kind as routes' op "moe" names it."""
    given = {"fp8": fp8, "int4": int4, "nvfp4": nvfp4, "int8": int8}
    kinds = [kind for kind, scales in given.items() if scales is not None]
    if len(kinds) > 1:
        raise ValueError("fused_moe: experts are FP8, INT8, INT4 or NVFP4, one of them")
    return kinds[0] if kinds else "dense"


def _projections(fp8: Fp8Scales | None, int4: Int4Scales | None, nvfp4: Nvfp4Scales | None = None,
                 int8: Int8Scales | None = None) -> tuple:
    """The scale arguments of the gate/up and the down projection, in expert_linear_ref's order (nvfp4:
    nvfp4_linear_ref's, int8: int8_linear_ref's)."""
    if nvfp4 is not None:
        return (nvfp4.w13_block, nvfp4.w13_global), (nvfp4.w2_block, nvfp4.w2_global)
    if int8 is not None:
        return (int8.w13_scale, int8.a13_scale, int8.w13_smooth), (int8.w2_scale, int8.a2_scale, int8.w2_smooth)
    if fp8 is not None:
        return (fp8.w13_scale, fp8.a13_scale), (fp8.w2_scale, fp8.a2_scale)
    if int4 is not None:
        return (int4.w13_scale, int4.w13_smooth), (int4.w2_scale, int4.w2_smooth)
    return (None, None), (None, None)


def expert_linear_ref(a: torch.Tensor, w: torch.Tensor, e: int, w_scale=None, a_scale=None) -> torch.Tensor:
    """a [M, K] @ w[e]^T in a's dtype; with FP8 scales: fake-quantized a (expert e's input scale) times the
    dequantized weight, in fp32; with INT4 (uint8 w): a_scale is the smoothing, moe.int4.int4_linear_ref."""
    if w_scale is None:
        return F.linear(a, w[e])
    if w.dtype == torch.uint8:
        return int4_linear_ref(a, w, e, w_scale, a_scale)
    if a_scale is None:  # per token, in a's dtype as formats.FP8_PER_CHANNEL_PER_TOKEN's reference linear
        aq = fake_quant_fp8_per_token(a).to(a.dtype).float()
        return (aq @ (w[e].float() * w_scale[e].float()[:, None]).t()).to(a.dtype)
    aq = fake_quant_fp8(a, a_scale[e].float())
    return (aq @ (w[e].float() * w_scale[e].float()[:, None]).t()).to(a.dtype)


def fused_moe_ref(x, w13, w2, topk_ids, topk_weights, fp8: Fp8Scales | None = None,
                  int4: Int4Scales | None = None, nvfp4: Nvfp4Scales | None = None,
                  int8: Int8Scales | None = None) -> torch.Tensor:
    """Torch reference: the (token, slot) pairs sorted by expert, one pair of GEMMs per expert that has any, then the
    weighted sum over each token's top_k rows."""
    kind = expert_kind(fp8, int4, nvfp4, int8)
    linear = {"nvfp4": nvfp4_linear_ref, "int8": int8_linear_ref}.get(kind, expert_linear_ref)
    s13, s2 = _projections(fp8, int4, nvfp4, int8)
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)  # row i: pair i's expert output
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        h = silu_and_mul_ref(linear(x[pairs // k], w13, e, *s13))
        rows[pairs] = linear(h, w2, e, *s2)
        start += n
    return combine_ref(rows, topk_weights)


def combine_ref(rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """rows [T * k, H] (pair order) -> sum_j topk_weights[t, j] * rows[t * k + j] in fp32, rounded to rows' dtype."""
    t, k = topk_weights.shape
    out = (rows.view(t, k, -1).float() * topk_weights.float().unsqueeze(-1)).sum(1)
    return out.to(rows.dtype)


def fused_moe_triton(x, w13, w2, topk_ids, topk_weights, block_m: int = BLOCK_M, fp8: Fp8Scales | None = None,
                     int4: Int4Scales | None = None, path: str | None = None,
                     nvfp4: Nvfp4Scales | None = None, int8: Int8Scales | None = None) -> torch.Tensor:
    """The Triton path (also under the CPU interpreter): gate/up GEMM, SiLU-and-mul, down GEMM, combine. path:
    "moe_grouped" (align, then grouped GEMMs), "moe_gemv" (per pair) or "moe_decode" (16-bit or static-FP8 experts:
    gate/up with SiLU, then down with the combine); None: routes' op "moe" decides."""
    kind = expert_kind(fp8, int4, nvfp4, int8)
    t, k = topk_ids.shape
    if path is None:
        arch = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        scale = "per_token" if fp8 is not None and fp8.a13_scale is None else "per_tensor"
        path = routes.route("moe", kind, t * k, 2 * w2.shape[2], x.shape[1], arch, scale=scale,
                            x16=x.dtype in (torch.bfloat16, torch.float16))
    if path == "moe_decode":
        s13, s2 = _projections(fp8, int4, nvfp4, int8)
        act = gate_up_silu(x, w13, topk_ids, k, *s13)
        out = down_combine(act, w2, topk_ids, topk_weights, *s2)
        if out is not None:
            return out
        return combine(_gemv_projection(act, w2, topk_ids, 1, kind, *s2), topk_weights)  # no workspace in a capture
    run = _gemv_projection if path == "moe_gemv" else _grouped_projection(topk_ids, w13.shape[0], block_m)
    s13, s2 = _projections(fp8, int4, nvfp4, int8)
    gate_up = run(x, w13, topk_ids, k, kind, *s13)
    if x.is_cuda:
        from lowbit.kernels.ops.activation import silu_and_mul
        act = silu_and_mul(gate_up)
    else:  # interpreter tests: the activation kernel has its own
        act = silu_and_mul_ref(gate_up)
    rows = run(act, w2, topk_ids, 1, kind, *s2)
    return combine(rows, topk_weights)


def _gemv_projection(a, w, topk_ids, a_row_div: int, kind: str, *scales) -> torch.Tensor:
    """One projection of every pair by moe.gemv: [T * k, N]."""
    if kind == "int8":
        return expert_gemv_int8(a, w, *scales, topk_ids, a_row_div)
    s1, s2 = scales
    if kind == "int4":
        return expert_gemv_int4(a, w, s1, s2, topk_ids, a_row_div)
    if kind == "nvfp4":
        return expert_gemv_nvfp4(a, w, s1, s2, topk_ids, a_row_div)
    return expert_gemv(a, w, topk_ids, a_row_div, s1, s2)


def _grouped_projection(topk_ids, num_experts: int, block_m: int):
    """The pairs aligned by expert once; -> a function running one projection as a grouped GEMM over them."""
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, block_m)
    pairs = topk_ids.numel()

    def run(a, w, _ids, a_row_div: int, kind: str, *scales) -> torch.Tensor:
        if kind == "int8":
            return grouped_gemm_int8(a, w, *scales, sorted_ids, block_expert, pairs, a_row_div, block_m)
        s1, s2 = scales
        if kind == "int4":
            return grouped_gemm_int4(a, w, s1, s2, sorted_ids, block_expert, pairs, a_row_div, block_m)
        if kind == "nvfp4":
            return grouped_gemm_nvfp4(a, w, s1, s2, sorted_ids, block_expert, pairs, a_row_div, block_m)
        return grouped_gemm(a, w, sorted_ids, block_expert, pairs, a_row_div, block_m, s1, s2)
    return run


def grouped_gemm(a, w, sorted_ids, block_expert, num_pairs: int, a_row_div: int, block_m: int,
                 w_scale=None, a_scale=None) -> torch.Tensor:
    """out[i] = a[i // a_row_div] @ w[expert of i]^T for every pair i listed in sorted_ids: [num_pairs, N] in a's
    dtype. With w_scale [E, N] and a_scale [E] (fp32), w is float8_e4m3fn and a is quantized per expert in the
    kernel; with w_scale and no a_scale, per token (token_scales)."""
    n, kdim = w.shape[1], w.shape[2]
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("grouped_gemm: a and w need unit stride along K")
    fp8, per_token = w_scale is not None, w_scale is not None and a_scale is None
    if per_token:
        a_scale = token_scales(a)
    if fp8 and (w.dtype != torch.float8_e4m3fn or tuple(w_scale.shape) != (w.shape[0], n)
                or (not per_token and tuple(a_scale.shape) != (w.shape[0],))):
        raise ValueError(f"grouped_gemm: FP8 needs float8_e4m3fn w [E, N, K] with w_scale [E, N] and a_scale [E]; "
                         f"got {w.dtype} {tuple(w.shape)}, {tuple(w_scale.shape)}, {tuple(a_scale.shape)}")
    if fp8:
        w_scale, a_scale = w_scale.float().contiguous(), a_scale.float().contiguous()
    else:  # unused pointers
        w_scale = a_scale = w
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](a, w, out, sorted_ids, block_expert, w_scale, a_scale, num_pairs, n, kdim, a.stride(0),
                               w.stride(0), w.stride(1), out.stride(0), A_ROW_DIV=a_row_div,
                               IEEE=a.dtype == torch.float32 and not fp8, FP8=fp8, PER_TOKEN=per_token,
                               BLOCK_M=block_m,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


@kernel
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, w_scale_ptr, a_scale_ptr, num_pairs, N, K,
                         stride_am, stride_we, stride_wn, stride_om, A_ROW_DIV: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_M sorted rows (all of one expert, or padding) x BLOCK_N output columns."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    wait_for_producers(PDL)
    if expert < 0:  # past the last expert's run
        return
    pairs, row_ok, a_rows = block_rows(sorted_ptr, pid_m, num_pairs, A_ROW_DIV, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PER_TOKEN:  # [BLOCK_M, 1]: each row's own scale (a_scale_ptr: one per row of a)
        a_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=1.0)[:, None]
    elif FP8:
        a_scale = tl.load(a_scale_ptr + expert)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP8:  # this expert's static input scale (or each row's); padding rows and columns past K are 0
            a = tl.minimum(tl.maximum(tl.div_rn(a.to(tl.float32), a_scale), -448.0), 448.0).to(tl.float8e4nv)
            acc = tl.dot(a, b, acc)
        elif IEEE:  # fp32 operands: full precision, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if FP8:
        w_scale = tl.load(w_scale_ptr + expert.to(tl.int64) * N + cols, mask=col_ok, other=0.0)
        acc = acc * a_scale * w_scale[None, :]
    out_rows = tl.where(row_ok, pairs, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def combine(rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """combine_ref as one kernel: each program sums one token's top_k rows over BLOCK columns."""
    t, k = topk_weights.shape
    hidden = rows.shape[1]
    out = torch.empty(t, hidden, dtype=rows.dtype, device=rows.device)
    block = min(1024, next_pow2(hidden))
    weights = topk_weights.float().contiguous()
    _combine_kernel[(t, cdiv(hidden, block))](rows, weights, out, hidden, TOP_K=k, BLOCK=block)
    return out


@kernel
def _combine_kernel(rows_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(w_ptr + tok * TOP_K + j)
        acc += wj * tl.load(rows_ptr + (tok * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
