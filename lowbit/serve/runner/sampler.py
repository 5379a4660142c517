"""Next-token choice for a batch: greedy, or temperature / top-k / top-p sampling, all rows at once on the logits'
device. Sampling is a race: token = argmax(probs / E) with Exp(1) noise E (lowbit.kernels.exponential_noise) drawn
from the request's seed and the token's position, so a seeded request gets the same tokens alone or in any batch.

Logprobs are those of the model's raw distribution (before temperature and truncation), as OpenAI and vLLM report.
"""
from dataclasses import dataclass

import torch

from lowbit.kernels import argmax_rows, exponential_noise
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.structured import apply_bitmask

TopLogprobs = list[tuple[int, float]]
_MASK64 = (1 << 64) - 1


def chosen_and_top(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int):
    """logprobs [R, V], token_ids [R] -> on the same device: logprob of token_ids[r] [R], the n best values and
    ids [R, n]."""
    values, ids = logprobs.topk(n, dim=-1)
    return logprobs.gather(1, token_ids.view(-1, 1)).view(-1), values, ids


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int) -> list[tuple[float, TopLogprobs]]:
    """logprobs [R, V], token_ids [R] -> per row (logprob of token_ids[r], [(id, logprob)] of the n best)."""
    chosen, values, ids = (t.tolist() for t in chosen_and_top(logprobs, token_ids, n))
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids, values)]


def step_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one (request seed, token position): splitmix64 of the pair."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def truncate(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """x [R, V] scaled logits -> the same with everything outside each row's top-k, then top-p, set to -inf.
    top-k keeps the k best ranks; top-p the smallest prefix (by rank) whose probability reaches p."""
    v = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = _on(x.device, [k if 0 < k < v else v for k in top_k], torch.int64)
    sorted_x = sorted_x.masked_fill(torch.arange(v, device=x.device)[None, :] >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = sorted_x.softmax(-1)
        p = _on(x.device, top_p, probs.dtype)
        sorted_x = sorted_x.masked_fill(probs.cumsum(-1) - probs > p[:, None], float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> torch.Tensor:
    """logits [R, V] float32 of non-greedy rows, one 63-bit seed per row -> token ids [R] (on logits' device)."""
    temperature = _on(logits.device, [p.temperature for p in params], logits.dtype)
    x = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        x = truncate(x, [p.top_k for p in params], [p.top_p for p in params])
    probs = x.softmax(-1)
    return argmax_rows(probs / exponential_noise(seeds, logits.shape[-1], logits.device))


def _on(device, values: list, dtype) -> torch.Tensor:
    """A small host list on `device` without waiting for the device (work queued before it keeps running): through
    pinned memory, which the caching host allocator does not hand out again before the copy has run."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class Sampler:
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
               bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """logits [S, V] float32; per row the request's seed and the position of the token being chosen -> token
        ids [S] int64 on logits' device. Never waits for the device, so the host can go on while it samples.
        bitmask: int32 [S, ceil(V / 32)] on the host, the tokens each row may take (structured output); it masks
        a copy, so logprobs stay those of the raw distribution."""
        if bitmask is not None:
            logits = logits.clone()
            apply_bitmask(logits, bitmask)
        tokens = argmax_rows(logits)
        rows = [r for r, p in enumerate(params) if not p.greedy]
        if rows:
            index = _on(logits.device, rows, torch.int64)
            chosen = sample_rows(logits.index_select(0, index), [params[r] for r in rows],
                                 [step_seed(seeds[r], positions[r]) for r in rows])
            tokens.index_copy_(0, index, chosen)
        return tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
                 bitmask: torch.Tensor | None = None):
        """As `sample`, then on the host: (token ids [S] list, per row (logprob, top) or None when not requested)."""
        tokens = self.sample(logits, params, seeds, positions, bitmask)
        logprobs = sampled_logprobs(logits, tokens, params)
        if logprobs is None:
            return tokens.tolist(), [None] * len(params)
        return tokens.tolist(), logprobs.entries(len(params), *(t.tolist() for t in logprobs.tensors))


@dataclass
class SampledLogprobs:
    """The sampled tokens' logprobs and each row's top n, still on the logits' device, for the rows that asked."""
    rows: list[int]  # the batch rows that asked for logprobs
    counts: list[int]  # how many top entries each of them wants
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # chosen [R], top values [R, n], top ids [R, n]

    def entries(self, num_rows: int, chosen: list, values: list, ids: list) -> list:
        """The tensors as host lists -> per batch row (logprob, [(id, logprob)] best first), or None."""
        out: list = [None] * num_rows
        for r, k, c, v, i in zip(self.rows, self.counts, chosen, values, ids):
            out[r] = (c, list(zip(i[:k], v[:k])))
        return out


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
                     ) -> SampledLogprobs | None:
    """logits [S, V] float32, tokens [S] -> the requested logprobs of the raw distribution, without waiting for
    the device; None when no row asks."""
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    counts = [params[r].logprobs for r in rows]
    index = _on(logits.device, rows, torch.int64)
    logprobs = logits.index_select(0, index).log_softmax(-1)
    return SampledLogprobs(rows, counts, chosen_and_top(logprobs, tokens.index_select(0, index), max(counts)))
