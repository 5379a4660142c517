"""Exponential noise for sampling by race: token = argmax(probs / E), E_v ~ Exp(1) i.i.d., draws token v with
probability probs[v]. Each row's noise is a function of its own 63-bit seed only (not of its batch), so a seeded
request samples the same tokens alone or in any batch.

The GPU kernel uses Triton's Philox generator; the CPU reference uses a torch.Generator per row. Both draw Exp(1)
from the same seed, but not the same values: a seed reproduces its tokens on the same kind of device.
"""
import torch

from lowbit.kernels._triton import HAS_TRITON, cdiv, kernel, tl, wait_for_producers

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
