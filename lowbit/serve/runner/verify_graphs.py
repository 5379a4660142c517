"""Multi-token steps (the speculative verify forward: k + 1 tokens per sequence over the paged KV) replayed from CUDA
graphs, one per (batch size, tokens per sequence q) in fixed sets; a batch runs in the next size and q up.

Layout: sequence row i owns token rows [i * q, (i + 1) * q) of the static buffers. A sequence with c < q new tokens
is padded at the back: its c tokens, then q - c padding tokens that store nothing (slot -1), with its context length
raised by q - c. The attention kernels place a row's query at context_len - q + j, so the real tokens keep their
positions and, being causal, never see the padding keys; padding rows attend to keys past the real ones (read
through the static block-table row, whatever it holds there) and their logits are dropped. Padding sequences past
the batch store nothing and attend to q keys. One kernel (lowbit.kernels.load_decode_inputs with tokens_per_row=q)
loads a step's uploaded, padded arrays into the static buffers; every graph writes all its rows' float32 logits into
one static output; the wanted rows are gathered after the replay.

Graph-safety: the extend attention (paged_prefill) sizes its grid from q (static per graph) and reads only device
tensors; the linear routes depend on the row count bs * q (static); nothing in the forward reads the host context
lengths on the Triton backend. Needs the same attention backend as DecodeGraphs.
"""
import numpy as np
import torch

from lowbit.kernels import load_decode_inputs
from lowbit.serve.runner.context import StepContext

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class VerifyGraphs:
    def __init__(self, model, max_batch_size: int, tokens, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, sizes=DEFAULT_SIZES):
        """tokens: the q values (new tokens per sequence, each >= 2) to capture; max_blocks_per_seq: the static
        block-table width (as wide as any table handed out)."""
        if not tokens or min(tokens) < 2:
            raise ValueError(f"verify graphs need q >= 2 tokens per sequence, got {sorted(tokens)}")
        self.model = model
        self.sizes = sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})
        self.tokens = sorted(set(tokens))
        self.block_size = block_size
        n, q = self.sizes[-1], self.tokens[-1]
        self.input_ids = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.full((n,), q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = {t: torch.arange(0, (n + 1) * t, t, dtype=torch.int32, device=device)
                                for t in self.tokens}
        self.rows = torch.arange(n * q, dtype=torch.int64, device=device)
        self.logits = None  # [n * q, V] float32, every graph's output (allocated by the first forward)
        self.context_lens_cpu = [q] * n  # host copy of the last load (a reference backend reads it; graphs do not)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch size, q)
        self.pool = None

    def _context(self, bs: int, q: int) -> StepContext:
        return StepContext(positions=self.positions[:bs * q], slot_mapping=self.slot_mapping[:bs * q],
                           query_start_loc=self.query_start_loc[q][:bs + 1], context_lens=self.context_lens[:bs],
                           block_tables=self.block_tables[:bs], logits_indices=self.rows[:bs * q], is_decode=False,
                           query_lens_cpu=[q] * bs, context_lens_cpu=self.context_lens_cpu[:bs])

    def _forward(self, bs: int, q: int) -> None:
        """The captured work: the model over the static buffers, all bs * q rows' logits into the static output."""
        hidden = self.model(self.input_ids[:bs * q], self._context(bs, q))
        logits = self.model.compute_logits(hidden)
        if self.logits is None:  # the first warm-up, outside any capture
            self.logits = logits.new_empty(len(self.rows), logits.shape[1])
        self.logits[:bs * q].copy_(logits)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Largest first, all graphs in one memory pool (pool: share another graph set's, e.g. the decode graphs')."""
        self.pool = pool
        for key in [(bs, q) for bs in reversed(self.sizes) for q in reversed(self.tokens)]:
            self._forward(*key)  # warm-up: compiles kernels (and their launch variants) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(*key)
            self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def key(self, host) -> tuple[int, int] | None:
        """host (HostInputs) -> the (batch size, q) graph that runs it, or None (eager): a step that is not pure
        decode, of at most the largest size, at most the largest q new tokens per sequence, whose padded contexts fit
        the static block tables."""
        if host.is_decode:
            return None
        b, counts = len(host.context_lens_cpu), host.query_lens_cpu
        most = max(counts)
        if b > self.sizes[-1] or most > self.tokens[-1] or host.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        q = next(t for t in self.tokens if t >= most)
        longest = max(n + q - c for n, c in zip(host.context_lens_cpu, counts))  # keys a padding row reads
        if -(-longest // self.block_size) > self.block_tables.shape[1]:
            return None
        return next(s for s in self.sizes if s >= b), q

    def can_run(self, host) -> bool:
        return self.key(host) is not None

    def run(self, host, upload, pending) -> torch.Tensor:
        """A step that `key` accepts -> float32 logits [len(host.logits_indices), V], as the eager forward returns
        (a view of the graphs' output, valid until the next replay, when the step needs no padding and wants every
        row). host: the step's HostInputs; upload: ModelRunner.upload; pending: PendingTokens or None."""
        bs, q = self.key(host)
        p = pad_rows(host, q)
        ids, positions, slots, context_lens, tables, gather, *source = upload(
            [p.input_ids, p.positions, p.slot_mapping, p.context_lens, host.block_tables, p.gather]
            + ([p.pending_source] if pending is not None else []))
        self.context_lens_cpu[:len(p.context_lens)] = p.context_lens.tolist()
        self.context_lens_cpu[len(p.context_lens):] = [q] * (len(self.context_lens_cpu) - len(p.context_lens))
        load_decode_inputs(ids, positions, slots, source[0] if source else ids,
                           pending.tokens if pending is not None else None, context_lens, tables,
                           self._static(bs, q), tokens_per_row=q)
        self.graphs[bs, q].replay()
        n = len(host.input_ids)
        if n == len(p.input_ids) and len(host.logits_indices) == n:  # no padding, every row: a view of the output
            return self.logits[:n]
        return self.logits[gather]

    def _static(self, bs: int, q: int) -> dict:
        return {"input_ids": self.input_ids[:bs * q], "positions": self.positions[:bs * q],
                "slot_mapping": self.slot_mapping[:bs * q], "context_lens": self.context_lens[:bs],
                "block_tables": self.block_tables[:bs]}


class PaddedRows:
    """A multi-token step's host arrays in the verify graphs' layout (sequence i's tokens at [i * q, (i + 1) * q))."""

    def __init__(self, input_ids, positions, slot_mapping, pending_source, context_lens, gather):
        self.input_ids = input_ids  # [b * q] int64; a padding token repeats its sequence's last new token
        self.positions = positions  # [b * q] int64; a padding token's is its sequence's last (a valid rotary row)
        self.slot_mapping = slot_mapping  # [b * q] int64; -1 for padding tokens
        self.pending_source = pending_source  # [b * q] int64 or None; a padding token's is its last new token's
        self.context_lens = context_lens  # [b] int32: context + q - (new tokens)
        self.gather = gather  # [R] int64: the padded row of each of host.logits_indices


def pad_rows(host, q: int) -> PaddedRows:
    """host (HostInputs) of b sequences with 1..q new tokens each -> the same step padded to q tokens per sequence."""
    counts = np.asarray(host.query_lens_cpu, np.int64)
    starts = host.query_start_loc[:-1].astype(np.int64)
    b = len(counts)
    seq, j = np.divmod(np.arange(b * q), q)
    real = j < counts[seq]
    src = starts[seq] + np.minimum(j, counts[seq] - 1)  # the flat token each padded row copies
    slots = np.where(real, host.slot_mapping[src], -1)
    source = None if host.pending_source is None else host.pending_source[src]  # padding: its last token's
    row_seq = np.searchsorted(starts, host.logits_indices, side="right") - 1
    gather = row_seq * q + host.logits_indices - starts[row_seq]
    return PaddedRows(host.input_ids[src], host.positions[src], slots, source,
                      (host.context_lens + (q - counts)).astype(np.int32), gather.astype(np.int64))
