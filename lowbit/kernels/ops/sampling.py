"""Exponential noise for sampling by race: token = argmax(probs / E), E_v ~ Exp(1) i.i.d., draws token v with
probability probs[v]. Each row's noise is a function of its own 63-bit seed only (not of its batch), so a seeded
request samples the same tokens alone or in any batch. And the argmax of each row (greedy tokens, the race's winner).

The GPU kernel uses Triton's Philox generator; the CPU reference uses a torch.Generator per row. Both draw Exp(1)
from the same seed, but not the same values: a seed reproduces its tokens on the same kind of device.
"""
import torch

from lowbit.kernels._triton import HAS_TRITON, cdiv, kernel, next_pow2, tl, wait_for_producers

_BLOCK = 4096


def exponential_noise_ref(seeds: list[int], vocab: int, device) -> torch.Tensor:
    """seeds: one non-negative 63-bit int per row -> [rows, vocab] float32, Exp(1) each."""
    rows = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        rows.append(torch.empty(vocab).exponential_(generator=g))
    return torch.stack(rows).to(device)


@kernel
def _exponential_kernel(seed_ptr, out_ptr, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row)
    u = tl.rand(seed, cols)  # uniform [0, 1): u = 0 gives +inf, a token that cannot win the race
    tl.store(out_ptr + row * V + cols, -tl.log(u), mask=cols < V)


def exponential_noise_triton(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds: int64 [rows] on the kernel's device."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    _exponential_kernel[(seeds.shape[0], cdiv(vocab, _BLOCK))](seeds, out, vocab, BLOCK=_BLOCK, num_warps=8)
    return out


def exponential_noise(seeds: list[int], vocab: int, device) -> torch.Tensor:
    """The kernel on a CUDA device (with Triton), the reference elsewhere."""
    if not (HAS_TRITON and torch.device(device).type == "cuda"):
        return exponential_noise_ref(seeds, vocab, device)
    seeds_host = torch.tensor(seeds, dtype=torch.int64).pin_memory()  # pinned: the copy never waits for the GPU
    return exponential_noise_triton(seeds_host.to(device, non_blocking=True), vocab)


_ARGMAX_BLOCK = 2048  # columns per program of the first pass


@kernel
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, V, stride, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the chunk's largest value and its first column."""
    wait_for_producers(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < V, other=float("-inf"))
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, chunk * BLOCK + at)


@kernel
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Program row: the first chunk holding the row's largest value gives its first column."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    best = tl.load(val_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    first = tl.argmax(best, 0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + first).to(tl.int64))


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] float32 (rows contiguous) -> int64 [R]: each row's first column holding its largest value, as
    torch.argmax(x, -1) for rows without NaN. Two launches: chunk maxima, then each row's winner."""
    rows, vocab = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1, (x.dtype, x.stride())
    chunks = cdiv(vocab, _ARGMAX_BLOCK)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_chunks_kernel[(rows, chunks)](x, val, idx, vocab, x.stride(0), chunks, BLOCK=_ARGMAX_BLOCK, num_warps=4)
    _argmax_rows_kernel[(rows,)](val, idx, out, chunks, CHUNKS=max(16, next_pow2(chunks)), num_warps=1)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R], torch.argmax(x, -1): the kernels for float32 on a CUDA device (with Triton), torch
    elsewhere. torch's one-block reduction takes ~28 us for one 128k-column row on the H200."""
    if not (HAS_TRITON and x.is_cuda and x.dtype == torch.float32) or x.shape[0] == 0:
        return x.argmax(-1)
    return argmax_rows_triton(x.contiguous())
