"""Decode steps replayed from CUDA graphs, one per batch size in a fixed set (a batch runs in the next size up), and a
second one for the sizes whose decode attention splits contexts over long_context(size) keys more finely
(lowbit.kernels.decode_splits), replayed when the batch's longest context is over it.

Each graph reads static input buffers (input ids, positions, slots, context lengths, block tables), which one kernel
(lowbit.kernels.load_decode_inputs) fills before each replay, and writes the logits of every row; padded rows store
nothing (slot -1) and attend to one key of an earlier row's block. A model with KV pools per layer kind has static
slots and tables per kind (kinds 1, ... filled by one more launch of the same kernel each). Nothing inside a replay
synchronises with the host. Needs an attention backend whose decode path reads device tensors only.
Graphs of at most ALL_EARLY_MAX_BATCH rows are captured with every Triton kernel launched early (PDL), so each
kernel's launch overlaps the one before it.
"""
import torch

from lowbit.kernels import all_kernels_early, decode_splits, load_decode_inputs, long_context
from lowbit.serve.runner.context import StepContext

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832,
                 896, 960, 1024)
# Graphs up to this batch size launch every kernel early (PDL), larger ones only the GEMVs: on the H200 all-early is
# faster at batch 1 and 2 for every format (bf16, fp8, int4_awq, nvfp4), slower at batch 4-8 for bf16, fp8 and nvfp4
# and at 16-64 for every format.
ALL_EARLY_MAX_BATCH = 2


class DecodeGraphs:
    def __init__(self, model, max_batch_size: int, max_blocks_per_seq: int, num_kv_heads: int, device: torch.device,
                 sizes=DEFAULT_SIZES, num_kinds: int = 1):
        self.model = model
        self.sizes = sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})
        self.long_sizes = {s for s in self.sizes
                           if decode_splits(s, num_kv_heads, long_context(s) + 1) != decode_splits(s, num_kv_heads)}
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # layer kinds 1, ...: their slots and tables, and where their load writes the fields kind 0's already holds
        self.kind_slots = [torch.full((n,), -1, dtype=torch.int64, device=device) for _ in range(num_kinds - 1)]
        self.kind_tables = [torch.zeros_like(self.block_tables) for _ in range(num_kinds - 1)]
        self.kind_scratch = {"input_ids": torch.zeros_like(self.input_ids),
                             "positions": torch.zeros_like(self.positions),
                             "context_lens": torch.ones_like(self.context_lens)}
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)  # every row's logits, in order
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, long contexts)
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None

    def _context(self, bs: int, long: bool) -> StepContext:
        """The step context a graph is captured with: its host-side context lengths only pick the split count."""
        ctx = StepContext(positions=self.positions[:bs], slot_mapping=self.slot_mapping[:bs],
                          query_start_loc=self.query_start_loc[:bs + 1], context_lens=self.context_lens[:bs],
                          block_tables=self.block_tables[:bs], logits_indices=self.rows[:bs],
                          is_decode=True, query_lens_cpu=[1] * bs,
                          context_lens_cpu=[long_context(bs) + 1 if long else 1] * bs)
        return ctx.with_kinds([(s[:bs], t[:bs]) for s, t in zip(self.kind_slots, self.kind_tables)])

    def _forward(self, bs: int, long: bool) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self._context(bs, long))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all graphs in one memory pool."""
        keys = [(bs, long) for bs in reversed(self.sizes) for long in (False, True)
                if not long or bs in self.long_sizes]
        for key in keys:
            with all_kernels_early(key[0] <= ALL_EARLY_MAX_BATCH):
                self._forward(*key)  # warm-up: compiles kernels (and their launch variants) outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[key] = self._forward(*key)
            self.pool = graph.pool()
            self.graphs[key] = graph
        self._build_input_load()
        torch.cuda.synchronize()

    def _build_input_load(self) -> None:
        """Compiles load_decode_inputs with and without pending tokens now, not at a request's first decode steps
        (it writes row 0's current values back, and zeros into the first 16 table entries of an idle engine)."""
        one, tables = self.input_ids[:1], torch.zeros(1, 16, dtype=torch.int32, device=self.input_ids.device)
        for pending in (None, one):
            load_decode_inputs(one.clone(), self.positions[:1].clone(), self.slot_mapping[:1].clone(),
                               torch.full_like(one, -1), pending, self.context_lens[:1].clone(), tables,
                               self._static(1))

    def can_run(self, host) -> bool:
        """host (HostInputs): a decode step of at most the largest size, every row's logits, tables no wider than
        the static ones."""
        return host.is_decode and len(host.context_lens) <= self.sizes[-1] and \
            len(host.logits_indices) == len(host.input_ids) and \
            all(t.shape[1] <= self.block_tables.shape[1] for t in [host.block_tables] + [t for _, t in host.kinds])

    def run(self, host, upload, pending) -> torch.Tensor:
        """A decode step of B sequences -> float32 logits [B, V] (a view of the graph's output).
        host: the step's HostInputs; upload: their one copy to the device (ModelRunner.upload); pending: the
        PendingTokens its inputs merge in, or None. One kernel writes the static buffers, then the graph replays."""
        b = len(host.context_lens)
        bs = next(s for s in self.sizes if s >= b)
        kinds = [a for pair in host.kinds for a in pair]
        ids, positions, slots, context_lens, tables, *rest = upload(
            [host.input_ids, host.positions, host.slot_mapping, host.context_lens, host.block_tables] + kinds
            + ([host.pending_source] if pending is not None else []))
        load_decode_inputs(ids, positions, slots, rest[-1] if pending is not None else ids,
                           pending.tokens if pending is not None else None, context_lens, tables, self._static(bs))
        for k in range(len(self.kind_slots)):  # the other kinds' slots (padding rows -1) and tables
            scratch = {name: buf[:bs] for name, buf in self.kind_scratch.items()}
            load_decode_inputs(ids, positions, rest[2 * k], ids, None, context_lens, rest[2 * k + 1],
                               scratch | {"slot_mapping": self.kind_slots[k][:bs],
                                          "block_tables": self.kind_tables[k][:bs]})
        key = (bs, bs in self.long_sizes and max(host.context_lens_cpu) > long_context(bs))
        self.graphs[key].replay()
        return self.logits[key][:b]

    def _static(self, bs: int) -> dict:
        """The static buffers of a graph of bs rows, as load_decode_inputs takes them."""
        return {"input_ids": self.input_ids[:bs], "positions": self.positions[:bs],
                "slot_mapping": self.slot_mapping[:bs], "context_lens": self.context_lens[:bs],
                "block_tables": self.block_tables[:bs]}
