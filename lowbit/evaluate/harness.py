"""Loglikelihood scoring for lm-eval: in-process (context computed once per document) or an OpenAI-style server."""
import contextlib
import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lm_eval.models.huggingface import HFLM

from lowbit.errors import UserError
from lowbit.evaluate import parallel


class SharedContextLM(HFLM):
    """HFLM (same tokenization, truncation and request handling) that runs each distinct context once.

    A multiple-choice document asks for log P(choice | context) for every choice: the context is encoded once and
    serves every choice. With exact=False (`lowbit eval --packed`) many documents share one padded forward
    pass (lowbit.evaluate.packed): equal to the one-document pass up to float rounding, which FP8 fake
    quantization amplifies. With exact=True each document's context runs once, its KV cache is repeated per
    choice and only the continuation tokens are run again; the logits are those of a full forward pass up to float
    rounding (tests compare against HFLM).

    Documents are shared out over `workers` forked processes (lowbit.evaluate.parallel); with exact=True each runs
    exactly this per-document computation on its own core, so the scores do not depend on the number of workers,
    and with `batch` > 1
    up to that many documents run in lockstep and share their linear layers' GEMMs (lowbit.evaluate.lockstep), each
    still computed row for row as alone: the scores do not depend on `batch` either.
    """
    workers: int = 1
    batch: int = 1
    exact: bool = True  # False: documents in padded batches (lowbit.evaluate.packed), equal up to float rounding

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        groups = defaultdict(list)  # truncated context tokens -> request indices
        for i, (_, ctx, cont) in enumerate(requests):
            full = (ctx + cont)[-(self.max_length + 1):]
            groups[tuple(full[:len(full) - len(cont)])].append(i)
        results = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Scoring (loglikelihood)")
        jobs = [(list(ctx), [requests[i][2] for i in idx]) for ctx, idx in groups.items()]
        scores = parallel.score_all(self.model, jobs, self.device, self.workers, self.batch, self.exact)
        for idx, scored in zip(groups.values(), scores):
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
    out = model(torch.tensor([ctx], device=device), use_cache=True, logits_to_keep=1)
    first = F.log_softmax(out.logits[0, -1].float(), dim=-1)  # [vocab]: predicts each cont's first token
    logprobs = first.expand(len(conts), 1, -1)  # [R, 1, vocab]
    if max(len(c) for c in conts) > 1:
        cache = out.past_key_values
        cache.batch_repeat_interleave(len(conts))
        tokens = _right_pad([c[:-1] for c in conts], device)  # [R, W]: pads come last, no real token sees one
        mask = _suffix_causal_mask(len(ctx), tokens.shape[1], out.logits.dtype, device)
        rest = model(tokens, attention_mask=mask, **{_cache_kwarg(model): cache}).logits
        logprobs = torch.cat([logprobs, F.log_softmax(rest.float(), dim=-1)], dim=1)  # [R, W + 1, vocab]
    answers = []
    for row, c in enumerate(conts):
        lp, target = logprobs[row, :len(c)], torch.tensor(c, device=device)
        answers.append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
    return answers


@torch.no_grad()
def score_continuations_lockstep(model, ctx: list[int], conts: list[list[int]], device) -> list[tuple[float, bool]]:
    """score_continuations, bitwise, for documents run in lockstep (lowbit.evaluate.lockstep): the padding rows of
    the continuation batch are declared (their GEMM rows skipped) and log-softmax runs only on scored positions."""
    from lowbit.evaluate.lockstep import real_rows

    out = model(torch.tensor([ctx], device=device), use_cache=True, logits_to_keep=1)
    first = F.log_softmax(out.logits[0, -1].float(), dim=-1)[None]  # [1, vocab]: predicts each cont's first token
    rest = None
    if max(len(c) for c in conts) > 1:
        cache = out.past_key_values
        cache.batch_repeat_interleave(len(conts))
        tokens = _right_pad([c[:-1] for c in conts], device)  # [R, W]
        real = torch.arange(tokens.shape[1], device=device)[None, :] < torch.tensor([len(c) - 1 for c in conts],
                                                                                    device=device)[:, None]
        mask = _suffix_causal_mask(len(ctx), tokens.shape[1], out.logits.dtype, device)
        with real_rows(real):
            logits = model(tokens, attention_mask=mask, **{_cache_kwarg(model): cache}).logits  # [R, W, vocab]
        rest = F.log_softmax(logits[real].float(), dim=-1)  # [sum(len - 1), vocab], continuation by continuation
    answers, offset = [], 0
    for c in conts:
        lp = first if len(c) == 1 else torch.cat([first, rest[offset:offset + len(c) - 1]])  # [len(c), vocab]
        offset += len(c) - 1
        target = torch.tensor(c, device=device)
        answers.append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
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


def inproc_lm(model, tokenizer, batch_size: int = 1, workers: int = 1, batch: int = 1,
              exact: bool = True) -> SharedContextLM:
    lm = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    lm.workers, lm.batch, lm.exact = workers, batch, exact
    return lm


def server_lm(url: str, model_name: str, tokenizer_path: str, concurrency: int = 1):
    """lm-eval's `local-completions`: token-id prompts, echo, logprobs, against URL/v1/completions."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from lowbit.calibrate.data import special_prefix
    from lowbit.evaluate.perplexity import completions_url

    lm = LocalCompletionsAPI(base_url=completions_url(url), model=model_name, tokenizer=tokenizer_path,
                             tokenizer_backend="huggingface", tokenized_requests=True,
                             num_concurrent=concurrency, max_retries=2)
    # lm-eval's API models encode without special tokens unless told; follow the tokenizer's own convention, as the
    # in-process HFLM does (BOS once at the start of each request's context)
    lm.add_bos_token = bool(special_prefix(lm.tokenizer))
    return lm


def run_task(lm, name: str, limit: int | None, manager=None, lean: bool = False) -> dict:
    """One task through lm-eval -> {task, n, metrics: {name: value}, per_doc: {name: [value per doc]}} (JSON-able).

    per_doc lists follow doc_id order, so two models' lists on the same task and limit are paired by position.
    lean: built-in tasks read only their first `limit` documents, and lm-eval's environment report (pip, git and
    torch's collect_env subprocesses, ~1 s a task; never read by lowbit) is skipped. Same documents, same scores.
    """
    from lm_eval import simple_evaluate

    from lowbit.evaluate.tasks import primary_metric, task_spec

    spec = task_spec(name, limit if lean else None)
    manager = manager or _manager_for(name)
    with _no_env_report() if lean else contextlib.nullcontext():
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


@contextlib.contextmanager
def _no_env_report():
    """lm-eval's simple_evaluate without its add_env_info / git-hash lookups (metadata in its results only)."""
    import lm_eval.evaluator as evaluator

    saved = evaluator.add_env_info, evaluator.get_git_commit_hash
    evaluator.add_env_info, evaluator.get_git_commit_hash = (lambda results: None), (lambda: None)
    try:
        yield
    finally:
        evaluator.add_env_info, evaluator.get_git_commit_hash = saved


def _is_number(v) -> bool:
    return isinstance(v, (int, float, bool))


def _manager_for(name: str):
    """Offline tasks need no index; anything else is looked up among lm-eval's own tasks (slower to index)."""
    from lm_eval.tasks import TaskManager

    from lowbit.evaluate.tasks import OFFLINE

    return TaskManager(include_defaults=name not in OFFLINE and not name.endswith((".yaml", ".yml")))
