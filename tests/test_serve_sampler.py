"""Batched sampling: the race argmax(probs / Exp(1)) draws from the truncated, tempered distribution; seeds make it
reproducible whatever the batch; the Triton noise kernel (CPU interpreter) draws Exp(1) as the reference does."""
import math

import pytest
import torch

from lowbit.kernels._triton import HAS_TRITON, interpreting
from lowbit.kernels.ops.sampling import exponential_noise_ref
from lowbit.serve.runner.sampler import Sampler, sample_rows, step_seed, truncate
from lowbit.serve.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
ROWS = 20000  # one row per draw: frequencies within ~3 standard errors (<= 0.011) of the target
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # cuda: the Triton noise kernel


def frequencies(params: SamplingParams, device="cpu") -> torch.Tensor:
    logits = LOGITS.expand(ROWS, -1).contiguous().to(device)
    tokens = sample_rows(logits, [params] * ROWS, [step_seed(i, 0) for i in range(ROWS)])
    return torch.bincount(tokens, minlength=LOGITS.numel()).float().cpu() / ROWS


def target(temperature, keep):
    p = torch.zeros_like(LOGITS)
    p[keep] = (LOGITS[keep] / temperature).softmax(-1)
    return p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_race_draws_from_the_tempered_distribution(temperature, device):
    freq = frequencies(SamplingParams(temperature=temperature), device)
    assert (freq - target(temperature, slice(None))).abs().max() < 0.012


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_truncate_then_renormalize(device):
    assert (frequencies(SamplingParams(top_k=2), device) - target(1.0, slice(0, 2))).abs().max() < 0.012
    p = LOGITS.softmax(-1)  # 0.49, 0.30, 0.18, ...: top_p 0.7 keeps the first two (0.49 < 0.7 <= 0.79)
    assert p[0] < 0.7 <= p[:2].sum()
    assert (frequencies(SamplingParams(top_p=0.7), device) - target(1.0, slice(0, 2))).abs().max() < 0.012
    x = truncate(LOGITS.expand(2, -1), [3, 0], [1.0, 0.5])  # row 0: top 3; row 1: top_p 0.5 keeps 2 (0.49 < 0.5)
    assert torch.isfinite(x).sum(1).tolist() == [3, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_are_the_same_in_any_batch_and_greedy_rows_take_the_argmax(device):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(top_p=0.9),
              SamplingParams(temperature=0.7, top_k=50)]
    tokens, _ = Sampler()(logits, params, seeds=[11, 12, 13, 14], positions=[5, 6, 7, 8])
    assert tokens[1] == logits[1].argmax().item()
    for r in (0, 2, 3):  # each row alone: same seed and position, same token
        alone, _ = Sampler()(logits[r:r + 1], [params[r]], seeds=[11 + r], positions=[5 + r])
        assert alone == [tokens[r]]
    other, _ = Sampler()(logits, params, seeds=[11, 12, 13, 14], positions=[6, 7, 8, 9])
    assert other != tokens  # the next position draws new noise


def test_step_seeds_differ_and_fit_63_bits():
    seeds = {step_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500 and max(seeds) < 2**63


def test_reference_noise_is_exponential():
    e = exponential_noise_ref([1, 2], 50000, "cpu")
    assert abs(e.mean().item() - 1) < 0.02 and abs((e > 1).float().mean().item() - math.exp(-1)) < 0.01


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter")
def test_triton_noise_is_exponential_and_seeded():
    from lowbit.kernels.ops.sampling import exponential_noise_triton

    seeds = torch.tensor([3, 2**62 + 1, 3], dtype=torch.int64)
    e = exponential_noise_triton(seeds, 20000)
    assert torch.equal(e, exponential_noise_triton(seeds, 20000)) and torch.equal(e[0], e[2])
    assert not torch.equal(e[0], e[1])
    assert abs(e.mean().item() - 1) < 0.03 and abs((e > 1).float().mean().item() - math.exp(-1)) < 0.01


def _argmax_cases(device):
    """Rows whose argmax is the first of tied maxima (in one chunk, across chunks), in the last ragged chunk, a
    constant row, one with -inf (truncated tokens), and random rows; vocab sizes around the kernel's 2048-column
    chunks."""
    g = torch.Generator().manual_seed(1)
    cases = []
    for vocab in (5, 2048, 2049, 6000, 128256):
        x = torch.randn(6, vocab, generator=g)
        x[0, vocab // 2] = x[0, vocab - 1] = 50.0  # tie across chunks (for vocab > 2048): the first wins
        x[1] = -2.0  # all equal: column 0
        x[2, -1] = 60.0  # the last column of a ragged last chunk
        x[3, : vocab // 2] = float("-inf")
        cases.append(x.to(device))
    return cases


@pytest.mark.skipif(not HAS_TRITON or not (interpreting() or torch.cuda.is_available()),
                    reason="needs the Triton interpreter or a GPU")
def test_triton_argmax_is_torch_argmax_first_of_ties():
    from lowbit.kernels.ops.sampling import argmax_rows_triton

    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    for x in _argmax_cases(device):
        got = argmax_rows_triton(x)
        assert got.dtype == torch.int64 and got.tolist() == x.argmax(-1).tolist(), x.shape
    x = _argmax_cases(device)[-1][::2]  # every other row: a row stride of twice the vocabulary
    assert argmax_rows_triton(x).tolist() == x.argmax(-1).tolist()
