"""Loglikelihood scoring for lm-eval: in-process (context computed once per document) or an OpenAI-style server."""
import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lm_eval.models.huggingface import HFLM

from lowbit.errors import UserError


TOKEN_BUDGET = 2048  # context + continuation tokens per forward pass: bounds the [rows, width, vocab] logits


class SharedContextLM(HFLM):
    """HFLM (same tokenization, truncation and request handling) that runs each distinct context once.

    A multiple-choice document asks for log P(choice | context) for every choice: the context is encoded once,
    its KV cache repeated per choice, and only the continuation tokens are run again. Documents whose contexts
    have the same length are batched, so no padding mask is needed: continuations are right-padded, and under
    causal attention no real token sees a pad. The logits are those of a full forward pass up to
    float rounding (tests compare against HFLM).
    """

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        groups = defaultdict(list)  # truncated context tokens -> request indices
        for i, (_, ctx, cont) in enumerate(requests):
            full = (ctx + cont)[-(self.max_length + 1):]
            groups[tuple(full[:len(full) - len(cont)])].append(i)
        results = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Scoring (loglikelihood)")
        for batch in _batches(sorted(groups.items(), key=lambda kv: -len(kv[0])), requests):
            conts = [[requests[i][2] for i in idx] for _, idx in batch]
            scored = score_batch(self.model, [list(ctx) for ctx, _ in batch], conts, self.device)
            for (_, idx), answers in zip(batch, scored):
                for i, answer in zip(idx, answers):
                    results[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(len(idx))
        pbar.close()
        return results


def _batches(groups: list, requests: list):
    """Consecutive (context, request indices) groups of one context length, within TOKEN_BUDGET padded tokens."""
    batch, cont_width, rows = [], 0, 0
    for ctx, idx in groups:
        w = max(len(requests[i][2]) for i in idx)
        size = len(ctx) * (len(batch) + 1) + max(cont_width, w) * (rows + len(idx))
        if batch and (len(ctx) != len(batch[0][0]) or size > TOKEN_BUDGET):
            yield batch
            batch, cont_width, rows = [], 0, 0
        batch.append((ctx, idx))
        cont_width, rows = max(cont_width, w), rows + len(idx)
    if batch:
        yield batch


@torch.no_grad()
def score_batch(model, ctxs: list[list[int]], conts: list[list[list[int]]], device) -> list[list[tuple[float, bool]]]:
    """For each context g and each of its continuations: (sum of log P(cont | ctx), cont is the greedy one).

    All contexts have the same length.
    """
    out = model(torch.tensor(ctxs, device=device), use_cache=True, logits_to_keep=1)
    first = F.log_softmax(out.logits[:, -1].float(), dim=-1)  # [G, vocab]: predicts each continuation's first token
    rows = torch.tensor([g for g, cs in enumerate(conts) for _ in cs], device=device)  # one row per continuation
    flat = [c for cs in conts for c in cs]
    logprobs = first[rows][:, None]  # [R, 1, vocab]
    if max(len(c) for c in flat) > 1:
        cache = out.past_key_values
        cache.batch_select_indices(rows)
        tokens = _right_pad([c[:-1] for c in flat], device)  # [R, W]
        mask = _suffix_causal_mask(len(ctxs[0]), tokens.shape[1], out.logits.dtype, device)
        rest = model(tokens, attention_mask=mask, **{_cache_kwarg(model): cache}).logits
        logprobs = torch.cat([logprobs, F.log_softmax(rest.float(), dim=-1)], dim=1)  # [R, W + 1, vocab]
    answers, r = [], 0
    for cs in conts:
        answers.append([])
        for c in cs:
            lp, target = logprobs[r, :len(c)], torch.tensor(c, device=device)
            answers[-1].append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
            r += 1
    return answers


def _suffix_causal_mask(past: int, width: int, dtype, device) -> torch.Tensor:
    """[1, 1, width, past + width] additive mask: new token i sees the past and new tokens 0..i.

    Given explicitly because transformers builds no mask for attention implementations registered without a mask
    function (the reference reader's FP8 KV attention), and SDPA's own is_causal aligns the causal triangle
    top-left when queries are fewer than keys: continuation tokens would not see their context.
    """
    allowed = torch.arange(past + width, device=device)[None, :] <= past + torch.arange(width, device=device)[:, None]
    mask = torch.zeros(width, past + width, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _right_pad(seqs: list[list[int]], device) -> torch.Tensor:
    """[B, width] token ids, 0-padded on the right."""
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long, device=device)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def inproc_lm(model, tokenizer, batch_size: int = 1) -> SharedContextLM:
    return SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def server_lm(url: str, model_name: str, tokenizer_path: str, concurrency: int = 1):
    """lm-eval's `local-completions`: token-id prompts, echo, logprobs, against URL/v1/completions."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from lowbit.evaluate.perplexity import completions_url

    return LocalCompletionsAPI(base_url=completions_url(url), model=model_name, tokenizer=tokenizer_path,
                               tokenizer_backend="huggingface", tokenized_requests=True,
                               num_concurrent=concurrency, max_retries=2)


def run_task(lm, name: str, limit: int | None, manager=None) -> dict:
    """One task through lm-eval -> {task, n, metrics: {name: value}, per_doc: {name: [value per doc]}} (JSON-able).

    per_doc lists follow doc_id order, so two models' lists on the same task and limit are paired by position.
    """
    from lm_eval import simple_evaluate

    from lowbit.evaluate.tasks import primary_metric, task_spec

    spec = task_spec(name)
    manager = manager or _manager_for(name)
    out = simple_evaluate(model=lm, tasks=[spec], task_manager=manager, limit=limit, log_samples=True,
                          bootstrap_iters=0)
    task = spec["task"] if isinstance(spec, dict) else next(iter(out["samples"]))
    if len(out["samples"]) != 1:
        raise UserError(f"{name} is a group of {len(out['samples'])} tasks: pass its tasks one by one")
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    metrics = {k.split(",")[0]: v for k, v in out["results"][task].items()
               if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
    per_doc = {m: [float(s[m]) for s in samples] for m in metrics if all(_is_number(s.get(m)) for s in samples)}
    return {"task": name, "n": len(samples), "primary": primary_metric(name, list(metrics)),
            "metrics": metrics, "per_doc": per_doc}


def _is_number(v) -> bool:
    return isinstance(v, (int, float, bool))


def _manager_for(name: str):
    """Offline tasks need no index; anything else is looked up among lm-eval's own tasks (slower to index)."""
    from lm_eval.tasks import TaskManager

    from lowbit.evaluate.tasks import OFFLINE

    return TaskManager(include_defaults=name not in OFFLINE and not name.endswith((".yaml", ".yml")))
