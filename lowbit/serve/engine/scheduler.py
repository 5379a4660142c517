"""FCFS continuous batching with a token budget, chunked prefill and preemption by recompute. Torch-free.

Each step: running sequences first (decodes, then prefill chunks, each oldest first), then
waiting ones while the batch and the budget allow. When blocks run out, the youngest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed later.
"""
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """One step's plan: seqs[i] computes tokens [num_computed_tokens, num_computed_tokens + num_new_tokens[i]).
    is_decode: every sequence computes exactly its newest token (the CUDA-graph shape); set when the plan is made."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_decode: bool = field(init=False)

    def __post_init__(self):
        self.is_decode = self.num_new_tokens.count(1) == len(self.seqs) and not any(s.in_prefill for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_tokens: int):
        assert max_batch_size > 0 and max_num_tokens > 0
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        seqs, counts = [], []
        budget = self.max_num_tokens
        preempted = self._schedule_running(seqs, counts, budget)
        budget -= sum(counts)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size and not preempted:
            seq = self.waiting[0]
            matched = self.block_manager.match_prefix(seq)
            restored = self.block_manager.match_host(seq, matched)  # host-pool blocks copied back, not recomputed
            num_cached = (len(matched) + len(restored)) * self.block_manager.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.can_allocate(seq, matched, len(restored) * self.block_manager.block_size + n):
                break
            self.block_manager.allocate(seq, matched, n, restored)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return Batch(seqs, counts) if seqs else None

    def _schedule_running(self, seqs: list, counts: list, budget: int) -> bool:
        """Appends the running sequences that fit, decodes before prefill chunks (so a long prompt never stalls
        the others' next token), each group oldest first; returns whether any sequence was preempted."""
        preempted = False
        for seq in sorted(self.running, key=attrgetter("in_prefill")):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.stopping:
                continue  # preempted earlier in this step, or its last token is in flight
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.block_manager.release_outside_window(seq)
            if not self.block_manager.has_room(seq, n):  # a decode needs a new block once every block_size steps
                while not self.block_manager.can_append(seq, n):
                    victim = self.running[-1]
                    if victim in seqs:  # scheduled earlier in this step: take its tokens back
                        i = seqs.index(victim)
                        budget += counts.pop(i)
                        seqs.pop(i)
                    self.preempt(victim)
                    preempted = True
                    if victim is seq:
                        return preempted
                self.block_manager.append(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return preempted

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: Batch, commit: bool = True) -> None:
        """After the step ran (or was launched): the planned tokens are computed. commit=False: the caller commits
        the blocks that became full later (`commit_full_blocks`), once every token in them is known."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        if commit:
            self.commit_full_blocks(batch.seqs)

    def commit_full_blocks(self, seqs: list[Sequence]) -> None:
        """Makes the blocks that became full and computed findable by later prompts (finished sequences skipped)."""
        bs = self.block_manager.block_size
        for seq in seqs:
            if seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * bs and not seq.is_finished:
                self.block_manager.commit(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence (finished or aborted), wherever it is, and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
