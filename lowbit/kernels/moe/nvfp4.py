"""NVFP4 experts of the fused MoE, weight-only (16-bit activations, as lowbit serves NVFP4 on Hopper): their scales,
the torch reference of one expert's linear, and the grouped GEMM and per-pair GEMV that decode the e2m1 codes and
e4m3 block scales in their K loops (each byte read once: its two elements meet x's even and odd columns).

Weights keep modelopt's on-disk layout, stacked: uint8 [E, N, K/2], element 2j of a row in the low nibble of byte j
and 2j + 1 in the high one (nibble = sign << 3 | e2m1 index). Block scales float8_e4m3fn [E, N, K/16] as on disk
(one per 16 elements along K); the global scale (weight_scale_2) fp32 per output row [E, N], so a merged gate/up
keeps gate's and up's own. w = e2m1 * (block_scale * global), the format's dequantize. The kernels multiply each
e2m1 value by its block scale (the product has at most 5 significant bits: exact in bf16 / fp16), run the dot in
x's dtype with fp32 accumulation, and apply the row's global scale to the sums.
"""
from typing import NamedTuple

import torch

from lowbit.formats.w4a16_nvfp4 import W4A16_NVFP4
from lowbit.kernels._triton import cdiv, helper, kernel, tl, wait_for_producers
from lowbit.kernels.moe.align import block_rows
from lowbit.kernels.moe.gemv import gemv_config, launch_gemv

BLOCK_N = 64  # output columns per grouped-GEMM program
BLOCK_K = 64  # K step of the grouped GEMM (four scale blocks; two dots of BLOCK_K / 2)


class Nvfp4Scales(NamedTuple):
    """Scales of NVFP4 experts on the weights' device: w13_block float8_e4m3fn [E, 2I, H/16], w13_global fp32
    [E, 2I], w2_block [E, H, I/16], w2_global [E, H]."""
    w13_block: torch.Tensor
    w13_global: torch.Tensor
    w2_block: torch.Tensor
    w2_global: torch.Tensor


def check_nvfp4(w: torch.Tensor, block: torch.Tensor, glob: torch.Tensor, where: str = "NVFP4 experts") -> None:
    """ValueError unless w uint8 [E, N, K/2], block float8_e4m3fn [E, N, K/16] and glob [E, N] fit together."""
    e, n, half = w.shape
    if (w.dtype != torch.uint8 or block.dtype != torch.float8_e4m3fn or tuple(block.shape) != (e, n, 2 * half // 16)
            or 2 * half % 16 or tuple(glob.shape) != (e, n)):
        raise ValueError(f"{where}: need uint8 weights [E, N, K/2], float8_e4m3fn block scales [E, N, K/16] and "
                         f"global scales [E, N]; got {w.dtype} {tuple(w.shape)}, {block.dtype} "
                         f"{tuple(block.shape)}, {tuple(glob.shape)}")


def nvfp4_linear_ref(a: torch.Tensor, w: torch.Tensor, e: int, block: torch.Tensor, glob: torch.Tensor):
    """a [M, K] through expert e: a in fp32 @ (W4A16_NVFP4.dequantize of expert e, row r scaled by glob[e, r])^T,
    returned in a's dtype (the format's reference linear, no activation quantization)."""
    t = {"weight": w[e], "weight_scale": block[e], "weight_scale_2": glob[e].float()[:, None]}
    return (a.float() @ W4A16_NVFP4.dequantize(t).t()).to(a.dtype)


def _args(w, block, glob):
    check_nvfp4(w, block, glob)
    return w.contiguous(), block.contiguous().view(torch.uint8), glob.float().contiguous()


def grouped_gemm_nvfp4(a, w, block, glob, sorted_ids, block_expert, num_pairs: int, a_row_div: int,
                       block_m: int) -> torch.Tensor:
    """out[i] = a[i // a_row_div] @ dequant(w[e])^T, e the expert of pair i, for every pair listed in sorted_ids:
    [num_pairs, N] in a's dtype (fused_moe.grouped_gemm's contract, NVFP4 weights)."""
    if a.stride(-1) != 1:
        raise ValueError("grouped_gemm_nvfp4: a needs unit stride along K")
    w, block, glob = _args(w, block, glob)
    n, kdim = w.shape[1], 2 * w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(n, BLOCK_N))
    _grouped_nvfp4_kernel[grid](a, w, block, glob, out, sorted_ids, block_expert, num_pairs, n, kdim, a.stride(0),
                                out.stride(0), A_ROW_DIV=a_row_div, IEEE=a.dtype == torch.float32, BLOCK_M=block_m,
                                BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def expert_gemv_nvfp4(a, w, block, glob, ids, a_row_div: int, config=None) -> torch.Tensor:
    """out[i] = a[i // a_row_div] @ dequant(w[ids[i]])^T per pair, BLOCK_N columns and a K range per program
    (moe.gemv's contract and tiles, NVFP4 weights; BLOCK_K is rounded up to a multiple of 32: whole scale blocks,
    two elements per byte)."""
    if a.stride(-1) != 1:
        raise ValueError("expert_gemv_nvfp4: a needs unit stride along K")
    w, block, glob = _args(w, block, glob)
    block_n, block_k, warps, split = gemv_config("nvfp4", config)
    return launch_gemv(_gemv_nvfp4_kernel, (a, w, block, glob, ids.reshape(-1).contiguous(), a.stride(0)),
                       ids.numel(), w.shape[1], 2 * w.shape[2], a.dtype, a.device,
                       (block_n, max(32, block_k), warps, split), A_ROW_DIV=a_row_div)


@helper
def e2m1_value(c):
    """int32 nibbles (sign << 3 | index) -> fp32 e2m1 values: index 2e + m is m / 2 for e = 0, else
    (1 + m / 2) * 2^(e - 1)."""
    idx = c & 7
    e = idx >> 1
    m = idx & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@helper
def e4m3_value(b):
    """int32 bytes of float8_e4m3fn (finite) -> fp32: exponent bias 7, subnormals m * 2^-9."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 128) != 0, -mag, mag)


@helper
def nvfp4_pairs(w_rows, s_rows, kb, ok):
    """The bytes at kb (byte columns, broadcast against the rows w_rows / s_rows) decoded: (even elements, odd
    elements), each fp32 e2m1 * its block scale (block kb // 8); 0 where not ok."""
    byte = tl.load(w_rows + kb, mask=ok, other=0).to(tl.int32)
    scale = e4m3_value(tl.load(s_rows + kb // 8, mask=ok, other=0).to(tl.int32))
    return e2m1_value(byte & 15) * scale, e2m1_value(byte >> 4) * scale


@kernel
def _grouped_nvfp4_kernel(a_ptr, w_ptr, bs_ptr, g_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, N, K,
                          stride_am, stride_om, A_ROW_DIV: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program: BLOCK_M sorted rows of one expert x BLOCK_N output columns. Each K step reads BLOCK_K / 2 bytes
    per column once and runs two dots: a's even columns with the low nibbles, its odd ones with the high."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    wait_for_producers(PDL)
    if expert < 0:  # past the last expert's run
        return
    e64 = expert.to(tl.int64)
    pairs, row_ok, a_rows = block_rows(sorted_ptr, pid_m, num_pairs, A_ROW_DIV, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + e64 * N * (K // 2) + cols[None, :].to(tl.int64) * (K // 2)  # [1, BLOCK_N]
    s_rows = bs_ptr + e64 * N * (K // 16) + cols[None, :].to(tl.int64) * (K // 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + tl.arange(0, HALF_K)  # byte columns: elements 2 kb and 2 kb + 1
        kb_ok = kb < K // 2
        a_even = a_ptr + a_rows[:, None] * stride_am + 2 * kb[None, :]
        a_ok = row_ok[:, None] & kb_ok[None, :]
        a0 = tl.load(a_even, mask=a_ok, other=0.0)
        a1 = tl.load(a_even + 1, mask=a_ok, other=0.0)
        b0, b1 = nvfp4_pairs(w_rows, s_rows, kb[:, None], kb_ok[:, None] & col_ok[None, :])  # [HALF_K, BLOCK_N]
        if IEEE:  # fp32 operands: full precision, not TF32
            acc = tl.dot(a0, b0, acc, input_precision="ieee")
            acc = tl.dot(a1, b1, acc, input_precision="ieee")
        else:  # exact in x's dtype (module docstring)
            acc = tl.dot(a0, b0.to(a_ptr.dtype.element_ty), acc)
            acc = tl.dot(a1, b1.to(a_ptr.dtype.element_ty), acc)
    acc = acc * tl.load(g_ptr + e64 * N + cols, mask=col_ok, other=0.0)[None, :]
    out_rows = tl.where(row_ok, pairs, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@kernel
def _gemv_nvfp4_kernel(a_ptr, w_ptr, bs_ptr, g_ptr, ids_ptr, stride_am, out_ptr, N, K, K_SPLIT, stride_os,
                       A_ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    HALF_K: tl.constexpr = BLOCK_K // 2
    pair, split = tl.program_id(0), tl.program_id(2)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wait_for_producers(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert * N * (K // 2) + cols[:, None].to(tl.int64) * (K // 2)  # [BLOCK_N, 1]
    s_rows = bs_ptr + expert * N * (K // 16) + cols[:, None].to(tl.int64) * (K // 16)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_begin = split * K_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        kb = k0 // 2 + tl.arange(0, HALF_K)  # byte columns: elements 2 kb and 2 kb + 1
        kb_ok = kb < K // 2
        a0 = tl.load(a_row + 2 * kb, mask=kb_ok, other=0.0).to(tl.float32)
        a1 = tl.load(a_row + 2 * kb + 1, mask=kb_ok, other=0.0).to(tl.float32)
        b0, b1 = nvfp4_pairs(w_rows, s_rows, kb[None, :], kb_ok[None, :] & col_ok[:, None])  # [BLOCK_N, HALF_K]
        acc += tl.sum(b0 * a0[None, :] + b1 * a1[None, :], axis=1)
    acc = acc * tl.load(g_ptr + expert * N + cols, mask=col_ok, other=0.0)
    out = out_ptr + split.to(tl.int64) * stride_os + pair.to(tl.int64) * N + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
