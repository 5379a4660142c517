"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling with a per-request generator.

Logprobs are those of the model's raw distribution (before temperature and truncation), as OpenAI and vLLM report.
"""
import torch

from lowbit.serve.sampling_params import SamplingParams

TopLogprobs = list[tuple[int, float]]


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int) -> list[tuple[float, TopLogprobs]]:
    """logprobs [R, V], token_ids [R] -> per row (logprob of token_ids[r], [(id, logprob)] of the n best)."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).view(-1).tolist()
    if n == 0:
        return [(c, []) for c in chosen]
    values, ids = logprobs.topk(n, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1).to(generator.device)  # the per-request generator lives on the CPU; logits may be on a GPU
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]):
        """logits [S, V] float32 -> (token ids [S] list, per row (logprob, top) or None when not requested)."""
        tokens = logits.argmax(dim=-1)
        for r, p in enumerate(params):
            if not p.greedy:
                tokens[r] = _sample_row(logits[r], p, generators[r])
        want = [r for r, p in enumerate(params) if p.logprobs is not None]
        logprobs: list = [None] * len(params)
        if want:
            n = max(params[r].logprobs for r in want)
            rows = top_logprobs(logits[want].log_softmax(-1), tokens[want], n)
            for r, (chosen, top) in zip(want, rows):
                logprobs[r] = (chosen, top[:params[r].logprobs])
        return tokens.tolist(), logprobs
