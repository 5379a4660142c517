"""Loglikelihood scoring for lm-eval: in-process (context computed once per document) or an OpenAI-style server."""
import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lm_eval.models.huggingface import HFLM

from lowbit.errors import UserError


class SharedContextLM(HFLM):
    """HFLM (same tokenization, truncation and request handling) that runs each distinct context once.

    A multiple-choice document asks for log P(choice | context) for every choice: the context is encoded once,
    its KV cache repeated per choice, and only the continuation tokens are run again. The logits are those of a
    full forward pass up to float rounding (tests compare against HFLM).
    """

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        groups = defaultdict(list)  # truncated context tokens -> request indices
        for i, (_, ctx, cont) in enumerate(requests):
            full = (ctx + cont)[-(self.max_length + 1):]
            groups[tuple(full[:len(full) - len(cont)])].append(i)
        results = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Scoring (loglikelihood)")
        for ctx, idx in groups.items():
            scored = score_continuations(self.model, list(ctx), [requests[i][2] for i in idx], self.device)
            for i, answer in zip(idx, scored):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            pbar.update(len(idx))
        pbar.close()
        return results


@torch.no_grad()
def score_continuations(model, ctx: list[int], conts: list[list[int]], device) -> list[tuple[float, bool]]:
    """(sum of log P(cont | ctx), cont is the greedy continuation) for each continuation."""
    n, width = len(conts), max(len(c) for c in conts)
    out = model(torch.tensor([ctx], device=device), use_cache=True, logits_to_keep=1)
    first = F.log_softmax(out.logits[0, -1].float(), dim=-1)  # [vocab]: predicts each cont's first token
    logprobs = first.expand(n, 1, -1)
    if width > 1:
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        tokens = torch.zeros(n, width - 1, dtype=torch.long, device=device)  # right padding: never attended to
        for row, c in enumerate(conts):
            tokens[row, :len(c) - 1] = torch.tensor(c[:-1])
        rest = F.log_softmax(model(tokens, **{_cache_kwarg(model): cache}).logits.float(), dim=-1)  # [n, width-1, vocab]
        logprobs = torch.cat([logprobs, rest], dim=1)
    answers = []
    for row, c in enumerate(conts):
        lp = logprobs[row, :len(c)]
        target = torch.tensor(c, device=lp.device)
        total = lp.gather(1, target[:, None]).sum()
        answers.append((float(total), bool((lp.argmax(-1) == target).all())))
    return answers


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def inproc_lm(model, tokenizer, batch_size: int = 1) -> SharedContextLM:
    return SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def server_lm(url: str, model_name: str, tokenizer_path: str, concurrency: int = 1):
    """lm-eval's `local-completions`: token-id prompts, echo, logprobs, against URL/v1/completions."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    base = url.rstrip("/")
    if not base.endswith("/v1/completions"):
        base += "/v1/completions"
    return LocalCompletionsAPI(base_url=base, model=model_name, tokenizer=tokenizer_path,
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
