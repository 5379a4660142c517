"""Draft-model drafting: a second (cheaper) model with the target's vocabulary proposes k greedy tokens per sequence.

The draft model runs in its own ModelRunner on the target's device, over its own paged KV pool (as many blocks as the
target's, sized out of one budget: runner/kv_cache.py `KvPartner`) managed by its own BlockManager without prefix
caching. Each target sequence has a shadow sequence there whose computed K/V cover a prefix of the target's tokens.
Drafting a sequence: catch up (compute the target's tokens the shadow lacks, the newest last, whose logits give
draft 1), then k - 1 one-token decode forwards, each batched over the sequences still drafting; every draft is the
argmax (a deterministic proposal, so spec/verify.py applies unchanged). After the verify step the shadow keeps the
K/V of the tokens the target accepted and gives back the rest (`BlockManager.truncate`). Prefix reuse and
preemption on the target side are not mirrored: a new or preempted sequence's shadow recomputes its whole history
at its next draft; a shadow that finds no room in the pool is dropped (recomputed later) and drafts nothing.
"""
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lowbit import checkpoint, models
from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.scheduler import Batch
from lowbit.serve.engine.sequence import Sequence, SequenceStatus


def load_draft_runner(config: EngineConfig, target_ckpt, draft_ckpt=None):
    """The draft model's runner (weights loaded, a placeholder pool: the target's runner sizes it with `kv_partner`).
    draft_ckpt: a checkpoint object instead of reading config.draft_model. Raises ValueError, naming the draft
    model, when its vocabulary differs from the target's."""
    from lowbit.serve.runner.model_runner import ModelRunner

    draft_ckpt = draft_ckpt or checkpoint.read(models.resolve(config.draft_model))
    check_same_vocabulary(target_ckpt, draft_ckpt, config.draft_model or str(draft_ckpt.path))
    draft_config = replace(config, num_kv_blocks=1, cuda_graphs=False, host_cache_size=0, speculative=None,
                           draft_model=None)
    return ModelRunner(draft_ckpt, draft_config, split_kv_kinds=False)  # its BlockManager has one pool


def check_same_vocabulary(target, draft, name: str) -> None:
    """Same vocab_size in config.json and, when both directories hold a tokenizer.json, the same token -> id map."""
    tv, dv = target.config.get("vocab_size"), draft.config.get("vocab_size")
    if tv != dv:
        raise ValueError(f"draft_model {name}: vocabulary of {dv} tokens, the target's has {tv}; a draft model "
                         f"needs the target's tokenizer")
    tok_t, tok_d = _vocab(target.path), _vocab(draft.path)
    if tok_t is not None and tok_d is not None and tok_t != tok_d:
        raise ValueError(f"draft_model {name}: its tokenizer maps tokens to other ids than the target's; a draft "
                         f"model needs the target's tokenizer")


def _vocab(path: Path) -> dict | None:
    """tokenizer.json's token -> id map (with the added tokens), or None when there is none."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    data = json.loads(f.read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return vocab


@dataclass
class Shadow:
    target: Sequence
    seq: Sequence  # in the draft pool: the target's tokens, then the drafts being computed
    synced: int  # leading tokens of seq known equal to the target's (its length at the last sync)


class DraftModelDrafter:
    """Greedy k-token drafts from a draft model, one shadow sequence per target sequence (module docstring)."""

    def __init__(self, runner, config: EngineConfig):
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, enable_prefix_caching=False,
                                          sliding_window=runner.sliding_window)
        self.max_num_tokens = config.max_num_tokens
        self.max_len = runner.model_config.get("max_position_embeddings", 4096)
        self.shadows: dict[int, Shadow] = {}  # by target seq_id

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """limits[i]: at most that many tokens for seqs[i] (0: none). Every token of seqs is on the host."""
        self.release_stale()
        drafts: list[list[int]] = [[] for _ in seqs]
        active = []  # (index in seqs, shadow, k)
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            k = min(k, self.max_len - seq.num_tokens + 1)  # the draft model's context holds its k - 1 drafts too
            if k > 0:
                shadow = self._reserve(seq, k)
                if shadow is not None:
                    active.append((i, shadow, k))
        if not active:
            return drafts
        first = self._catch_up([s for _, s, _ in active])
        for (i, _, _), token in zip(active, first):
            drafts[i].append(token)
        for j in range(1, max(k for _, _, k in active)):  # draft j + 1 from draft j, one decode forward
            step = [(i, s) for i, s, k in active if k > j]
            for i, s in step:
                s.token_ids.append(drafts[i][-1])
            tokens = self._forward([s for _, s in step], [1] * len(step))
            for (i, _), token in zip(step, tokens):
                drafts[i].append(token)
        return drafts

    def after_verify(self, seqs: list[Sequence]) -> None:
        """Rolls each shadow back to the K/V of the tokens its target accepted; finished targets' shadows go."""
        for seq in seqs:
            if seq.seq_id in self.shadows:
                if seq.is_finished:
                    self.release(seq)
                else:
                    self._sync(self.shadows[seq.seq_id])

    def release(self, seq: Sequence) -> None:
        """Frees the shadow of a target sequence (finished, aborted, preempted); nothing when it has none."""
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.block_manager.deallocate(entry.seq)

    def release_stale(self) -> None:
        """Frees the shadows whose targets no longer run (finished or preempted: recomputed when they draft)."""
        for entry in list(self.shadows.values()):
            if entry.target.status is not SequenceStatus.RUNNING:
                self.release(entry.target)

    def _sync(self, entry: Shadow) -> None:
        """The shadow's tokens := the target's; its computed K/V kept up to the first token that differs (a rejected
        draft) and short of the target's newest token, the blocks past them given back. The target only appends, so only tokens from `synced` on can
        differ."""
        seq, shadow = entry.target, entry.seq
        n = min(shadow.num_computed_tokens, seq.num_tokens - 1)  # the newest token's logits give the next draft
        match = next((p for p in range(min(entry.synced, n), n) if shadow.token_ids[p] != seq.token_ids[p]), n)
        shadow.num_computed_tokens = match
        entry.synced = seq.num_tokens
        del shadow.token_ids[match:]
        shadow.token_ids.extend(seq.token_ids[match:])
        self.block_manager.truncate(shadow, match)

    def _reserve(self, seq: Sequence, k: int) -> Sequence | None:
        """seq's shadow, synced, with blocks for its catch-up and k - 1 drafts; None (shadow dropped) when the pool
        has no room."""
        bm = self.block_manager
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(seq.token_ids, seq.params, f"draft-{seq.request_id}")
            shadow.status = SequenceStatus.RUNNING
            self.shadows[seq.seq_id] = Shadow(seq, shadow, seq.num_tokens)
        else:
            shadow = entry.seq
            self._sync(entry)
        bm.release_outside_window(shadow)
        need = seq.num_tokens - shadow.num_computed_tokens + k - 1
        if not bm.has_room(shadow, need):
            if not bm.can_append(shadow, need):
                self.release(seq)
                return None
            bm.append(shadow, need)
        return shadow

    def _catch_up(self, shadows: list[Sequence]) -> list[int]:
        """Computes every token each shadow lacks, in forwards of at most max_num_tokens tokens (each shadow's newest
        token in the last one); returns each shadow's first draft."""
        while True:
            counts = [s.num_tokens - s.num_computed_tokens for s in shadows]
            if sum(counts) <= self.max_num_tokens or max(counts) == 1:  # (more sequences than the budget: one go)
                return self._forward(shadows, counts)
            budget, chunk = self.max_num_tokens, []
            for c in counts:  # all but the newest token, oldest sequences first
                chunk.append(min(c - 1, budget))
                budget -= chunk[-1]
            part = [(s, n) for s, n in zip(shadows, chunk) if n > 0]
            self._forward([s for s, _ in part], [n for _, n in part], logits=False)

    @torch.inference_mode()
    def _forward(self, shadows: list[Sequence], counts: list[int], logits: bool = True) -> list[int]:
        """One draft-model forward of counts[i] new tokens of shadows[i]; the argmax at each one's last token."""
        rows = [[n - 1] if logits else [] for n in counts]
        out = self.runner.run(Batch(shadows, counts), rows)
        for s, n in zip(shadows, counts):
            s.num_computed_tokens += n
        return out.argmax(-1).tolist() if logits else []

    def gauges(self) -> dict[str, tuple[float, str]]:
        return {"lowbit_spec_draft_kv_blocks_used": (self.block_manager.num_used_blocks,
                                                     "Draft model KV cache blocks in use."),
                "lowbit_spec_draft_kv_blocks_total": (self.block_manager.num_blocks,
                                                      "Draft model KV cache blocks in the pool.")}
