"""The output side of the W4 GEMM kernels (w4a16, w4_small_m), which compute out^T tiles and may split K across
programs: a tile's store (the output itself, or split pid_k's fp32 partial) and the sum of the partials."""
import torch

from lowbit.kernels._triton import cdiv, helper, kernel, tl, wait_for_producers


@helper
def store_out_t(acc, out_ptr, bias_ptr, pid_k, M, N, offs_m, offs_n, n_rows, global_scale, HAS_BIAS: tl.constexpr):
    """acc [BN, BM] fp32 = rows offs_n, columns offs_m of out^T -> out [M, N] (or split pid_k's [M, N] partial)."""
    out = acc * global_scale
    if HAS_BIAS:
        out += tl.load(bias_ptr + n_rows).to(tl.float32)[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + pid_k * M * N + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@kernel
def _split_sum_kernel(ws_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_sum(partials, bias, out) -> None:
    """out [M, N] = partials [split, M, N] (fp32) summed over the splits (+ bias), in out's dtype."""
    split, M, N = partials.shape
    block = 1024
    _split_sum_kernel[(cdiv(M * N, block),)](partials, bias if bias is not None else partials, out, M * N, N,
                                             SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def partials_or_out(split: int, out: torch.Tensor) -> torch.Tensor:
    """Where a launch's tiles go: out itself, or an fp32 [split, M, N] workspace for split_sum."""
    return out if split == 1 else torch.empty(split, *out.shape, dtype=torch.float32, device=out.device)
