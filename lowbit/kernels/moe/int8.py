"""INT8 W8A8 (SmoothQuant) experts of the fused MoE: their scales, the torch reference of one expert's linear, and the
grouped GEMM that smooths and quantizes its input rows in the K loop and multiplies int8 by int8 into int32.

As the dense W8A8_SQ_PER_CHANNEL format, per expert: weights int8 [N, K] in [-127, 127] with one fp32 scale per output
row; the input row times pre_quant_scale [K] rounded to x's dtype, then q = round(clamp(xs / input_scale, -128, 127))
with the expert's static per-tensor input scale. out = (q @ w^T in int32) * input_scale * w_scale[n], rounded once to
x's dtype. Stacked: w13 [E, 2I, H] (gate rows then up rows, which share input_scale and pre_quant_scale), w2 [E, H, I].
"""
from typing import NamedTuple

import torch

from lowbit.formats.numerics import fake_quant_int8
from lowbit.kernels._triton import cdiv, helper, kernel, tl, wait_for_producers
from lowbit.kernels.moe.align import block_rows

BLOCK_N = 64
BLOCK_K = 64


class Int8Scales(NamedTuple):
    """Scales of INT8 experts, fp32 on the weights' device: w13_scale [E, 2I] and w2_scale [E, H] (one per output row),
    a13_scale [E] and a2_scale [E] (static input scales), w13_smooth [E, H] and w2_smooth [E, I] (pre_quant_scale,
    ones where a checkpoint has none)."""
    w13_scale: torch.Tensor
    a13_scale: torch.Tensor
    w13_smooth: torch.Tensor
    w2_scale: torch.Tensor
    a2_scale: torch.Tensor
    w2_smooth: torch.Tensor


def int8_linear_ref(a: torch.Tensor, w: torch.Tensor, e: int, w_scale: torch.Tensor, a_scale: torch.Tensor,
                    smooth: torch.Tensor) -> torch.Tensor:
    """a [M, K] through expert e: fake-quantized (a * smooth[e] in a's dtype) @ (w[e] * w_scale[e])^T in fp32, in
    a's dtype."""
    xq = fake_quant_int8(a * smooth[e].to(a.dtype), a_scale[e].float())
    return (xq @ (w[e].float() * w_scale[e].float()[:, None]).t()).to(a.dtype)


def check_int8(a, w, w_scale, a_scale, smooth, where: str):
    """ValueError unless int8 w [E, N, K], w_scale [E, N], a_scale [E], smooth [E, K] fit and a is K-contiguous;
    -> the scales as contiguous fp32."""
    e, n, k = w.shape
    if (w.dtype != torch.int8 or tuple(w_scale.shape) != (e, n) or tuple(a_scale.shape) != (e,)
            or tuple(smooth.shape) != (e, k) or a.stride(-1) != 1 or w.stride(-1) != 1):
        raise ValueError(f"{where}: INT8 needs K-contiguous int8 w [E, N, K] with w_scale [E, N], a_scale [E] and "
                         f"smooth [E, K]; got {w.dtype} {tuple(w.shape)}, {tuple(w_scale.shape)}, "
                         f"{tuple(a_scale.shape)}, {tuple(smooth.shape)}")
    return tuple(s.float().contiguous() for s in (w_scale, a_scale, smooth))


def grouped_gemm_int8(a, w, w_scale, a_scale, smooth, sorted_ids, block_expert, num_pairs: int, a_row_div: int,
                      block_m: int) -> torch.Tensor:
    """out[i] = Q_e(a[i // a_row_div] * smooth[e]) @ w[e]^T, e the expert of pair i, for every pair listed in
    sorted_ids: [num_pairs, N] in a's dtype (fused_moe.grouped_gemm's contract, INT8 experts)."""
    w_scale, a_scale, smooth = check_int8(a, w, w_scale, a_scale, smooth, "grouped_gemm_int8")
    n, kdim = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(n, BLOCK_N))
    _grouped_int8_kernel[grid](a, w, w_scale, a_scale, smooth, out, sorted_ids, block_expert, num_pairs, n, kdim,
                               a.stride(0), out.stride(0), A_ROW_DIV=a_row_div, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                               BLOCK_K=BLOCK_K)
    return out


@helper
def quantize_int8(a, smooth, a_scale):
    """a (x's dtype) times smooth (rounded to x's dtype), divided by a_scale, rounded half to even and clamped to
    [-128, 127] -> int8 (the format's fake_quant_int8)."""
    xs = (a.to(tl.float32) * smooth.to(a.dtype).to(tl.float32)).to(a.dtype).to(tl.float32)
    v = tl.minimum(tl.maximum(tl.div_rn(xs, a_scale), -128.0), 127.0)
    return ((v + 12582912.0) - 12582912.0).to(tl.int8)  # 1.5 * 2**23: round to nearest, ties to even


@kernel
def _grouped_int8_kernel(a_ptr, w_ptr, ws_ptr, as_ptr, smooth_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                         N, K, stride_am, stride_om, A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_M sorted rows of one expert x BLOCK_N output columns; exact int32 sums, scaled once."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    wait_for_producers(PDL)
    if expert < 0:  # past the last expert's run
        return
    e64 = expert.to(tl.int64)
    pairs, row_ok, a_rows = block_rows(sorted_ptr, pid_m, num_pairs, A_ROW_DIV, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + e64 * N * K + cols[None, :].to(tl.int64) * K
    a_scale = tl.load(as_ptr + e64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        q = quantize_int8(a, tl.load(smooth_ptr + e64 * K + ks, mask=k_ok, other=0.0)[None, :], a_scale)
        b = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(q, b, acc, out_dtype=tl.int32)
    w_scale = tl.load(ws_ptr + e64 * N + cols, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * a_scale * w_scale[None, :]
    out_rows = tl.where(row_ok, pairs, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
