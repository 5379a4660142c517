"""Acceptance of drafted tokens against the target's distributions (greedy and sampled), preserving the target's law.

Every drafter here makes a deterministic proposal: given the context, draft token t (a point mass q = 1[t]).
Standard speculative rejection sampling then accepts t with probability min(1, p(t) / q(t)) = p(t) and, on rejection,
draws from the residual norm(max(p - q, 0)), which for a point mass is p with t removed and renormalised,
p(x) / (1 - p(t)) for x != t. Drawing x ~ p and accepting iff x == t has the same joint law: P(accept) = p(t), and
x given x != t is distributed as p(x) / (1 - p(t)). So each row draws the target's own token with the engine's
sampler (temperature, top-k, top-p, the request's seed and the token's position), drafts are accepted while they
equal it, and the first disagreeing row's draw is the correction token; when all k agree, row k's draw is the bonus
token. The draws are exactly those non-speculative decoding makes at the same positions, so greedy and seeded
outputs are identical to decoding without speculation (up to the forward's numerics: one k+1-token extend instead
of k+1 one-token steps). Logprobs are those of the raw distribution at the emitted rows.
"""
import torch

from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.runner.sampler import Sampler, sampled_logprobs


def emitted(draft: list[int], drawn: list[int]) -> list[int]:
    """drawn[j]: the target's token at row j (len(draft) + 1 rows) -> the tokens to emit: the agreeing prefix of
    draft, then the target's token after it."""
    j = 0
    while j < len(draft) and drawn[j] == draft[j]:
        j += 1
    return drawn[:j + 1]


def verify(sampler: Sampler, logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           seeds: list[int], first_positions: list[int]) -> list[tuple[list[int], list]]:
    """logits [sum(len(d) + 1), V] float32: per sequence i, rows predicting positions first_positions[i] + j,
    j = 0..len(drafts[i]) -> per sequence (emitted tokens, their logprob entries or None each)."""
    row_params, row_seeds, row_positions = [], [], []
    for d, p, s, pos in zip(drafts, params, seeds, first_positions):
        row_params += [p] * (len(d) + 1)
        row_seeds += [s] * (len(d) + 1)
        row_positions += range(pos, pos + len(d) + 1)
    tokens = sampler.sample(logits, row_params, row_seeds, row_positions)
    logprobs = sampled_logprobs(logits, tokens, row_params)
    drawn = tokens.tolist()
    entries = logprobs.entries(len(drawn), *(t.tolist() for t in logprobs.tensors)) if logprobs else [None] * len(drawn)
    out, at = [], 0
    for d in drafts:
        tokens_i = emitted(d, drawn[at:at + len(d) + 1])
        out.append((tokens_i, entries[at:at + len(tokens_i)]))
        at += len(d) + 1
    return out
