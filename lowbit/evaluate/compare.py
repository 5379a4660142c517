"""Candidate vs baseline on the same documents and the same held-out sequences, with standard errors.

Recovery of one task = candidate score / baseline score on its primary metric (acc_norm, or acc), over the same
documents. Its standard error comes from a paired bootstrap over documents: both models are resampled together,
so documents both get right or both get wrong add no noise; only disagreements do.
The aggregate `recovery` is the unweighted mean of the per-task recoveries; tasks are independent samples, so its
standard error is sqrt(sum se_t^2) / n_tasks.
"""
import math

import numpy as np

BOOTSTRAP_ITERS = 2000


def mean_se(values) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return float(v.mean()), se


def paired_recovery(baseline, candidate, iters: int = BOOTSTRAP_ITERS, seed: int = 0) -> tuple[float, float]:
    """mean(candidate) / mean(baseline) and its paired-bootstrap standard error. Inputs: per-document scores."""
    b = np.asarray(baseline, dtype=np.float64)
    c = np.asarray(candidate, dtype=np.float64)
    if b.shape != c.shape:
        raise ValueError(f"baseline has {b.size} documents, candidate {c.size}: they must be the same documents")
    if b.sum() == 0:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, b.size, size=(iters, b.size))
    b_means = b[idx].mean(1)
    ratios = c[idx].mean(1)[b_means > 0] / b_means[b_means > 0]
    return float(c.mean() / b.mean()), float(ratios.std(ddof=1))


def task_comparison(base: dict, cand: dict) -> dict:
    """Two run_task results of one task -> scores, recovery and standard errors on the primary metric."""
    metric = base["primary"]
    b, c = base["per_doc"][metric], cand["per_doc"][metric]
    recovery, recovery_se = paired_recovery(b, c)
    return {"metric": metric, "n": len(b), "baseline": mean_se(b), "candidate": mean_se(c),
            "recovery": (recovery, recovery_se)}


def aggregate_recovery(per_task: list[tuple[float, float]]) -> tuple[float, float]:
    values = [r for r, _ in per_task]
    ses = [se for _, se in per_task]
    return float(np.mean(values)), math.sqrt(sum(se * se for se in ses)) / len(ses)


def text_comparison(base_nll, cand: dict, tokens_per_seq: int) -> dict:
    """Held-out text: perplexity ratio, KL and top-1 agreement as (value, se, dof), se over the S sequences.

    base_nll: [S] baseline nll sums (nats) per sequence; cand: compare_pass output (nll sums, per-sequence means).
    The ppl ratio's se is that of log(ratio) (gate.LOG_SCALE).
    """
    d = (np.asarray(cand["nll"]) - np.asarray(base_nll, dtype=np.float64)) / tokens_per_seq  # [S] log ppl ratio
    log_ratio, log_se = mean_se(d)
    dof = len(d) - 1
    out = {"ppl_ratio": (math.exp(log_ratio), log_se, dof)}
    for k in ("kl", "top1"):  # None when the candidate was scored through a server
        out[k] = (*mean_se(cand[k]), dof) if cand[k] is not None else None
    return out


def perplexity(nll_sums, tokens_per_seq: int) -> float:
    return math.exp(float(np.sum(nll_sums)) / (len(nll_sums) * tokens_per_seq))
