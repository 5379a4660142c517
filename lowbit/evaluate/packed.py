"""`lowbit eval --packed`: many documents in one forward pass, each document one row of a padded batch.

A row holds a document's context followed by each continuation (all but its last token); a tree mask lets every
continuation see the context and its own earlier tokens only, and its position ids continue from the context, so
each continuation is computed as if appended to the context alone. Rows are sorted by length and batched up to a
token budget; the lm_head runs only on scored positions. Every GEMM then has hundreds of rows and transformers'
per-layer Python runs once per batch instead of twice per document.

The results equal the one-document pass (harness.score_continuations) up to float rounding: GEMMs of other row
counts and attention over padded rows round differently, which FP8 fake quantization amplifies (SmolLM2 FP8: up to
14 % of a continuation's loglikelihood, `acc` different in 2 of 600 documents of the default gate); so it is not
the default. Compared with that path in tests and in `lowbit bench eval-speed --packed`.
"""
import contextlib

import torch
import torch.nn.functional as F

TOKENS = 1024  # padded tokens (rows x width) of one forward pass


def row_length(ctx: list[int], conts: list[list[int]]) -> int:
    return len(ctx) + sum(len(c) - 1 for c in conts)


def score_packed(model, jobs: list, device, tokens: int = TOKENS):
    """Yields [(sum of log P(cont | ctx), cont is greedy) per continuation] for each (ctx, conts) job, in order."""
    order = sorted(range(len(jobs)), key=lambda i: row_length(*jobs[i]))
    done, next_out = {}, 0
    for batch in _batches(order, [row_length(*job) for job in jobs], tokens):
        for i, answers in zip(batch, _score_batch(model, [jobs[i] for i in batch], device)):
            done[i] = answers
        while next_out in done:
            yield done.pop(next_out)
            next_out += 1


def _batches(order: list[int], lengths: list[int], tokens: int) -> list[list[int]]:
    """Runs of `order` whose padded size (rows x the longest row) stays within `tokens` (a longer row runs alone)."""
    batches = [[]]
    for i in order:  # ascending length: the row added is the longest
        if batches[-1] and (len(batches[-1]) + 1) * lengths[i] > tokens:
            batches.append([])
        batches[-1].append(i)
    return batches


@torch.no_grad()
def _score_batch(model, jobs: list, device) -> list[list[tuple[float, bool]]]:
    width = max(row_length(*job) for job in jobs)
    ids = torch.zeros(len(jobs), width, dtype=torch.long)
    pos = torch.zeros(len(jobs), width, dtype=torch.long)
    seg = torch.full((len(jobs), width), -1, dtype=torch.long)  # 0: context, j: continuation j, -1: padding
    scored = torch.zeros(len(jobs), width, dtype=torch.bool)  # positions whose next-token log-probs are read
    rows, targets, spans = [], [], []  # per scored token: its position in the flat scored list, its target id
    n_scored = 0
    for b, (ctx, conts) in enumerate(jobs):
        c = len(ctx)
        ids[b, :c], pos[b, :c], seg[b, :c] = torch.tensor(ctx), torch.arange(c), 0
        scored[b, c - 1] = True
        first, at, next_row = n_scored, c, n_scored + 1  # flat index of the context's last position
        for j, cont in enumerate(conts, 1):
            n = len(cont) - 1
            ids[b, at:at + n], pos[b, at:at + n], seg[b, at:at + n] = torch.tensor(cont[:-1]), torch.arange(c, c + n), j
            scored[b, at:at + n] = True
            spans.append((len(rows), len(cont)))
            rows += [first] + list(range(next_row, next_row + n))
            targets += cont
            at, next_row = at + n, next_row + n
        n_scored = next_row
    with _lm_head_on(model, scored.to(device)):
        logits = model(input_ids=ids.to(device), attention_mask=_tree_mask(seg, model.dtype, device),
                       position_ids=pos.to(device), use_cache=False, logits_to_keep=0).logits[0]  # [n_scored, vocab]
    logprobs = F.log_softmax(logits.float(), dim=-1)
    rows, targets = torch.tensor(rows, device=device), torch.tensor(targets, device=device)
    token_lp = logprobs[rows, targets].tolist()
    greedy = (logprobs.argmax(-1)[rows] == targets).tolist()
    answers, k = [], 0
    for ctx, conts in jobs:
        answers.append([(float(sum(token_lp[s:s + n])), all(greedy[s:s + n])) for s, n in spans[k:k + len(conts)]])
        k += len(conts)
    return answers


def _tree_mask(seg: torch.Tensor, dtype, device) -> torch.Tensor:
    """[B, 1, W, W] additive mask: a token sees the earlier context tokens and earlier tokens of its own segment;
    padding sees only itself (its outputs are never read)."""
    q, k = seg[:, :, None], seg[:, None, :]
    idx = torch.arange(seg.shape[1])
    causal = idx[None, :, None] >= idx[None, None, :]
    allowed = causal & (k >= 0) & ((k == 0) | (k == q)) | torch.eye(seg.shape[1], dtype=torch.bool)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None].to(device)


@contextlib.contextmanager
def _lm_head_on(model, scored: torch.Tensor):
    """The output embedding sees only the hidden states at `scored` [B, W] positions, as one row [1, n, hidden]; the
    model's own code after it (soft-capping, logit scaling) runs unchanged."""
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][scored][None],) + args[1:])
    try:
        yield
    finally:
        handle.remove()
