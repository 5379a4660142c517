"""Perplexity on held-out text, and next-token agreement (KL, top-1) with a baseline's cached distributions.

A baseline pass keeps, per predicted position, its top-K log-probabilities (K = TOP_K) so the baseline is never
re-run. KL(baseline || candidate) is computed over K+1 bins: the baseline's top-K tokens and one bin for the rest
of the vocabulary. By the log-sum inequality this is a lower bound of the full-vocabulary KL; the gap is the
divergence inside the tail bin, weighted by its baseline mass (reported as `tail_mass`).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.errors import UserError

SOURCES = ("boolq", "lambada")  # held-out splits only: never the calibration text
SEQ_LEN = 512
NUM_SEQS = 4  # per source, by default (--ppl-seqs)
TOP_K = 256


@dataclass
class TextPass:
    """One model over the held-out sequences. S sequences, T = SEQ_LEN - 1 predicted positions each."""
    source: list[str]  # [S] which held-out text each sequence comes from
    ids: torch.Tensor  # [S, SEQ_LEN] int64 token ids
    nll: torch.Tensor  # [S, T] float32, -log P(token) in nats
    top_logprobs: torch.Tensor  # [S, T, K] float32, descending
    top_ids: torch.Tensor  # [S, T, K] int64


def heldout_sequences(tokenizer, num_seqs: int) -> list[tuple[str, list[int]]]:
    seqs = []
    for source in SOURCES:
        for ids in token_batches(tokenizer, builtin_texts(source, "heldout"), num_seqs, SEQ_LEN, seed=0):
            seqs.append((source, ids))
    return seqs


@torch.no_grad()
def sequence_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32 log-probabilities of the next token at each position but the last."""
    x = torch.tensor([ids], device=model.device)
    return F.log_softmax(model(x).logits[0, :-1].float(), dim=-1)


def text_pass(model, tokenizer, num_seqs: int = NUM_SEQS, desc: str = "held-out text") -> TextPass:
    seqs = heldout_sequences(tokenizer, num_seqs)
    nll, top_lp, top_ids = [], [], []
    for _, ids in tqdm(seqs, desc=f"Perplexity ({desc})"):
        lp = sequence_logprobs(model, ids)
        target = torch.tensor(ids[1:], device=lp.device)
        nll.append(-lp.gather(1, target[:, None])[:, 0].cpu())
        values, indices = lp.topk(TOP_K, dim=-1)
        top_lp.append(values.cpu())
        top_ids.append(indices.cpu())
    ids = torch.tensor([ids for _, ids in seqs])
    return TextPass([s for s, _ in seqs], ids, torch.stack(nll), torch.stack(top_lp), torch.stack(top_ids))


def agreement(baseline: TextPass, candidate_lp: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position binned KL(baseline || candidate) [T] and top-1 agreement [T] for sequence s.

    candidate_lp: [T, vocab] candidate log-probabilities for the same sequence.
    """
    ids = baseline.top_ids[s].to(candidate_lp.device)
    p_lp = baseline.top_logprobs[s].to(candidate_lp.device)
    q_lp = candidate_lp.gather(1, ids)
    p_tail = (1 - p_lp.exp().sum(-1)).clamp_min(0)
    q_tail = (1 - q_lp.exp().sum(-1)).clamp_min(1e-30)
    head = (p_lp.exp() * (p_lp - q_lp)).sum(-1)
    tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(1e-30).log() - q_tail.log()), torch.zeros_like(p_tail))
    top1 = (candidate_lp.argmax(-1) == ids[:, 0]).float()
    return (head + tail).cpu(), top1.cpu()


@torch.no_grad()
def compare_pass(model, tokenizer, baseline: TextPass) -> dict:
    """Candidate over the baseline's sequences -> per-sequence nll sums, KL and top-1 means (lists of length S)."""
    num_seqs = baseline.ids.shape[0] // len(SOURCES)
    mine = torch.tensor([ids for _, ids in heldout_sequences(tokenizer, num_seqs)])
    if not torch.equal(mine, baseline.ids):
        raise UserError("the candidate's tokenizer splits the held-out text differently from the baseline's: "
                        "KL and perplexity ratio compare only models that share a tokenizer")
    out = {"source": [], "nll": [], "kl": [], "top1": []}
    for s, (source, row) in enumerate(zip(tqdm(baseline.source, desc="Perplexity + KL (candidate)"), baseline.ids)):
        ids = row.tolist()
        lp = sequence_logprobs(model, ids)
        target = torch.tensor(ids[1:], device=lp.device)
        kl, top1 = agreement(baseline, lp, s)
        out["source"].append(source)
        out["nll"].append(float(-lp.gather(1, target[:, None]).sum()))
        out["kl"].append(float(kl.mean()))
        out["top1"].append(float(top1.mean()))
    return out


def tail_mass(baseline: TextPass) -> float:
    """Mean baseline probability outside its top-K: how much of the distribution the binned KL sees as one bin."""
    return float((1 - baseline.top_logprobs.exp().sum(-1)).clamp_min(0).mean())


def served_compare_pass(url: str, model_name: str, baseline: TextPass) -> dict:
    """compare_pass through an OpenAI-compatible server: nll sums from echoed prompt logprobs.

    A server returns log-probabilities of the prompt tokens but not full distributions: KL and top-1 agreement
    are not measured this way (None).
    """
    out = {"source": list(baseline.source), "nll": [], "kl": None, "top1": None}
    for row in tqdm(baseline.ids, desc="Perplexity (server)"):
        ids = row.tolist()
        logprobs = _echo_logprobs(url, model_name, ids)
        if len(logprobs) < len(ids) or any(lp is None for lp in logprobs[1:len(ids)]):
            raise UserError(f"{url} did not return a log-probability for every prompt token (needs echo + logprobs)")
        out["nll"].append(-sum(logprobs[1:len(ids)]))
    return out


def _echo_logprobs(url: str, model_name: str, ids: list[int]) -> list:
    import json
    import urllib.error
    import urllib.request

    body = {"model": model_name, "prompt": [ids], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    request = urllib.request.Request(completions_url(url), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            reply = json.loads(response.read())
    except urllib.error.URLError as e:
        raise UserError(f"server {url}: {e}") from e
    return reply["choices"][0]["logprobs"]["token_logprobs"]


def completions_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1/completions") else base + "/v1/completions"
