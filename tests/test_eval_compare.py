"""Recovery statistics and the binned KL (no model needed)."""
import math

import numpy as np
import torch

from lowbit.evaluate import compare, perplexity


def test_identical_models_recover_exactly():
    b = np.random.default_rng(0).integers(0, 2, 200)
    r, se = compare.paired_recovery(b, b)
    assert r == 1.0 and se == 0.0


def test_paired_se_counts_only_disagreements():
    rng = np.random.default_rng(1)
    b = rng.integers(0, 2, 400).astype(float)
    few = b.copy()
    few[np.flatnonzero(b)[:4]] = 0  # 4 documents lost
    many = rng.integers(0, 2, 400).astype(float)  # an unrelated model with similar accuracy
    r_few, se_few = compare.paired_recovery(b, few)
    _, se_many = compare.paired_recovery(b, many)
    assert math.isclose(r_few, few.mean() / b.mean())
    assert se_few < se_many / 4


def test_aggregate_recovery_is_mean_with_independent_errors():
    r, se = compare.aggregate_recovery([(1.0, 0.03), (0.9, 0.04)])
    assert math.isclose(r, 0.95) and math.isclose(se, 0.025)


def test_ppl_ratio():
    base = [100.0, 110.0]
    cand = {"nll": [110.0, 121.0], "kl": [0.01, 0.02], "top1": [0.9, 0.8]}
    out = compare.text_comparison(base, cand, tokens_per_seq=10)
    assert math.isclose(out["ppl_ratio"][0], math.exp(1.05), rel_tol=1e-9)
    assert math.isclose(out["ppl_ratio"][1], 0.05) and out["ppl_ratio"][2] == 1  # se of log ratio, dof
    assert math.isclose(out["kl"][0], 0.015)


def _pass_for(lp: torch.Tensor, k: int) -> perplexity.TextPass:
    values, ids = lp.topk(k, dim=-1)
    return perplexity.TextPass(["x"], torch.zeros(1, 2, dtype=torch.long), None, values[None], ids[None])


def test_binned_kl_is_a_lower_bound_that_is_exact_without_a_tail():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 50, generator=g) * 3, -1)
    q = torch.log_softmax(p + 0.3 * torch.randn(5, 50, generator=g), -1)
    exact = (p.exp() * (p - q)).sum(-1)
    full, top1 = perplexity.agreement(_pass_for(p, 50), q, 0)
    assert torch.allclose(full, exact, atol=1e-5)
    binned, _ = perplexity.agreement(_pass_for(p, 8), q, 0)
    assert (binned <= exact + 1e-6).all() and (binned > 0).all()
    assert torch.equal(top1, (p.argmax(-1) == q.argmax(-1)).float())
