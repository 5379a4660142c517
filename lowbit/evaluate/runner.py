"""One evaluation: baseline (cached) and candidate over the same tasks and held-out text, then the comparison."""
import time
from dataclasses import dataclass, field
from pathlib import Path

from lowbit.errors import UserError
from lowbit.evaluate import cache, compare, perplexity
from lowbit.evaluate.harness import inproc_lm, run_task, server_lm
from lowbit.evaluate.lockstep import DEFAULT_BATCH
from lowbit.evaluate.tasks import fingerprint

TEXT_TASK = "ppl"  # perplexity, KL and top-1 agreement on held-out text


@dataclass
class Plan:
    tasks: list[str]
    limit: int | None
    text_seqs: int = perplexity.NUM_SEQS  # held-out sequences per text source
    use_cache: bool = True
    workers: int = 1  # in-process scoring: forked worker processes (evaluate/parallel.py)
    batch: int = DEFAULT_BATCH  # in-process scoring: documents run in lockstep, sharing GEMMs (evaluate/lockstep.py)
    exact: bool = True  # scores bitwise those of one document at a time (batch: lockstep); False: packed.py
    lean: bool = True  # lm-eval reads only the first `limit` documents and skips its environment report

    @property
    def lm_tasks(self) -> list[str]:
        return [t for t in self.tasks if t != TEXT_TASK]


@dataclass
class Side:
    """The model under one role. Loaded on first use: a fully cached baseline is never loaded."""
    name: str  # as the user gave it (store name, directory); also the model name sent to a server
    path: Path
    url: str | None = None  # an OpenAI-compatible server serving this model, instead of loading it here
    _loaded: tuple | None = field(default=None, repr=False)

    def model(self):
        if self._loaded is None:
            from lowbit.checkpoint import load_reference_model

            self._loaded = load_reference_model(self.path)
        return self._loaded

    def lm(self, plan: "Plan"):
        if self.url:
            return server_lm(self.url, self.name, str(self.path))
        model, tokenizer = self.model()
        return inproc_lm(model, tokenizer, workers=plan.workers, batch=plan.batch, exact=plan.exact)


def baseline_results(side: Side, plan: Plan) -> dict:
    """{tasks: {name: run_task result}, text: TextPass | None, cached: [names read from the cache]}."""
    digest = cache.model_hash(side.path)
    out, cached, lm = {"tasks": {}, "text": None}, [], None
    for name in plan.lm_tasks:
        task_file = fingerprint(name)
        k = cache.key(digest, name, {"limit": plan.limit} | ({"task_file": task_file} if task_file else {})
                      | ({} if plan.exact else {"scoring": "packed"}))  # the exact path never reads --packed's scores
        result = cache.load_json(k) if plan.use_cache else None
        if result is None:
            lm = lm or side.lm(plan)
            result = run_task(lm, name, plan.limit, lean=plan.lean)
            cache.save_json(k, result)
        else:
            cached.append(name)
        out["tasks"][name] = result
    if TEXT_TASK in plan.tasks:
        k = cache.key(digest, TEXT_TASK, {"seqs": plan.text_seqs, "seq_len": perplexity.SEQ_LEN,
                                          "top_k": perplexity.TOP_K})
        stored = cache.load_tensors(k) if plan.use_cache else None
        if stored is None:
            model, tokenizer = side.model()
            stored = vars(perplexity.text_pass(model, tokenizer, plan.text_seqs, desc="baseline"))
            cache.save_tensors(k, stored)
        else:
            cached.append(TEXT_TASK)
        out["text"] = perplexity.TextPass(**stored)
    out["cached"] = cached
    return out


def candidate_results(side: Side, plan: Plan, baseline_text) -> dict:
    """{tasks: {...}, text: compare_pass output (with a baseline) or TextPass (without)}."""
    out = {"tasks": {}, "text": None}
    lm = side.lm(plan) if plan.lm_tasks else None
    for name in plan.lm_tasks:
        out["tasks"][name] = run_task(lm, name, plan.limit, lean=plan.lean)
    if TEXT_TASK in plan.tasks and side.url:
        if baseline_text is None:
            raise UserError("ppl through a server compares with a baseline: pass --baseline")
        out["text"] = perplexity.served_compare_pass(side.url, side.name, baseline_text)
    elif TEXT_TASK in plan.tasks:
        model, tokenizer = side.model()
        if baseline_text is None:
            out["text"] = perplexity.text_pass(model, tokenizer, plan.text_seqs, desc="candidate")
        else:
            out["text"] = perplexity.compare_pass(model, tokenizer, baseline_text)
    return out


def evaluate(candidate: Side, baseline: Side | None, plan: Plan) -> dict:
    """Scores of both sides and their comparison, JSON-able (see report.py for the layout)."""
    t0 = time.time()
    base = baseline_results(baseline, plan) if baseline else None
    t1 = time.time()
    cand = candidate_results(candidate, plan, base["text"] if base else None)
    t2 = time.time()
    result = {"tasks": _task_table(base, cand), "text": _text_table(base, cand), "summary": {},
              "baseline_cached": base["cached"] if base else [],
              "timing_s": {"baseline": round(t1 - t0, 1), "candidate": round(t2 - t1, 1)}}
    if base:
        result["summary"] = _summary(result)
    return result


def _task_table(base, cand) -> dict:
    table = {}
    for name, c in cand["tasks"].items():
        metric = c["primary"]
        row = {"metric": metric, "n": c["n"], "candidate": compare.mean_se(c["per_doc"][metric]),
               "candidate_metrics": c["metrics"]}
        if base:
            row.update(compare.task_comparison(base["tasks"][name], c))
            row["baseline_metrics"] = base["tasks"][name]["metrics"]
        table[name] = row
    return table


def _text_table(base, cand) -> dict | None:
    text = cand["text"]
    if text is None:
        return None
    tokens = perplexity.SEQ_LEN - 1
    if base is None:
        nll = text.nll.sum(-1).tolist()
        return {"ppl": {s: {"candidate": _source_ppl(nll, text.source, s, tokens)} for s in perplexity.SOURCES}}
    b = base["text"]
    b_nll = b.nll.sum(-1).tolist()
    ppl = {s: {"baseline": _source_ppl(b_nll, b.source, s, tokens),
               "candidate": _source_ppl(text["nll"], text["source"], s, tokens)} for s in perplexity.SOURCES}
    return {"ppl": ppl, **compare.text_comparison(b_nll, text, tokens), "sequences": len(b_nll),
            "tokens": len(b_nll) * tokens, "top_k": perplexity.TOP_K, "tail_mass": perplexity.tail_mass(b)}


def _source_ppl(nll: list, sources: list, source: str, tokens: int) -> float:
    return compare.perplexity([x for x, s in zip(nll, sources) if s == source], tokens)


def _summary(result: dict) -> dict:
    summary = {}
    recoveries = {name: row["recovery"] for name, row in result["tasks"].items() if "recovery" in row}
    for name, r in recoveries.items():
        summary[f"{name}.recovery"] = r
    if recoveries:
        summary["recovery"] = compare.aggregate_recovery(list(recoveries.values()))
    if result["text"]:
        for k in ("ppl_ratio", "kl", "top1"):
            if result["text"].get(k) is not None:
                summary[k] = result["text"][k]
    return summary
