"""Runs one scheduled step: flattens the batch into the model's inputs and the step context, returns logits."""
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from lowbit.checkpoint import Checkpoint
from lowbit.kernels.decode_inputs import merge_pending
from lowbit.serve.attention import Attention
from lowbit.serve.config import EngineConfig
from lowbit.serve.context import StepContext
from lowbit.serve.kv_pool import gpu_blocks_that_fit, warm_up_peak
from lowbit.serve.loader import load_model, model_dtype
from lowbit.serve.scheduler import Batch

_TORCH = {np.int64: torch.int64, np.int32: torch.int32}  # upload's dtypes
# Block tables go to the kernels this many entries wide (a multiple): the attention kernels take the row stride as an
# int argument, which Triton specializes on divisibility by 16, so a width that only grows would compile a new kernel
# variant (~1 s, mid-run) the first step the longest table reaches 16 * k blocks.
TABLE_WIDTH_MULTIPLE = 16
UPLOAD_ALIGN_BYTES = 16
# Prefills run before the pool is sized, besides the max_num_tokens one that measures the peak: two per row range of
# the W4 GEMM configs (w4a16._m_bucket: <= 16, <= 32, <= 64, <= 128, <= 512, more), a multiple of 16 and not (Triton
# specializes integer arguments on divisibility by 16), so no request compiles a kernel for its prompt length (~1-2 s
# for a 128- or 300-token prompt of an int4_awq engine, benchmarks.md run 41). The larger ones also grow
# w4_dequant's scratch (W4 layers from w4a16.DEQUANT_MIN_M rows) to its final size before the pool is sized and
# graphs captured.
WARM_UP_PREFILLS = (15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 1023)


class ModelRunner:
    def __init__(self, ckpt: Checkpoint, config: EngineConfig):
        self.config = config
        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.dtype = model_dtype(ckpt, config.dtype)
        self.model = load_model(ckpt, self.device, self.dtype)
        self.kv_dtype = torch.float8_e4m3fn if ckpt.kv_algo == "FP8" else self.dtype
        if ckpt.kv_algo not in (None, "FP8"):
            raise ValueError(f"kv_cache_quant_algo {ckpt.kv_algo!r} is not supported (FP8 or none)")
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        gpu_attention = _use_gpu_attention(self.device.type == "cuda")
        bs = config.block_size
        if gpu_attention and self.kv_dtype == torch.float8_e4m3fn and bs & (bs - 1):
            raise ValueError(f"block_size {bs}: an FP8 KV cache on the GPU needs a power of two (its V is read "
                             f"block by block)")
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        a = self.attn_layers[0]
        shape = (2, self.num_blocks, config.block_size, a.num_kv_heads, a.head_dim)
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.block_tables = BlockTables(config.max_batch_size, 64)
        self.graphs = None
        if gpu_attention and config.cuda_graphs:
            self.graphs = self._capture_decode_graphs(ckpt.config)

    def _capture_decode_graphs(self, model_config: dict):
        from lowbit.serve.cuda_graphs import DecodeGraphs

        bs = self.config.block_size
        limits = [model_config.get("max_position_embeddings", 4096), self.num_blocks * bs, self.config.max_model_len]
        max_len = min(x for x in limits if x)
        max_blocks = -(-max_len // bs)
        width = -(-max_blocks // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE  # as wide as any table handed out
        num_kv_heads = model_config.get("num_key_value_heads") or model_config["num_attention_heads"]
        graphs = DecodeGraphs(self.model, self.config.max_batch_size, width, num_kv_heads, self.device)
        graphs.capture()
        return graphs

    @property
    def block_bytes(self) -> int:
        per_token = sum(2 * m.num_kv_heads * m.head_dim for m in self.attn_layers)
        return per_token * self.config.block_size * torch.empty((), dtype=self.kv_dtype).element_size()

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            for n in (n for n in WARM_UP_PREFILLS if n < self.config.max_num_tokens):  # they only build kernels
                warm_up_peak(self.model, self.attn_layers, n, self.config.block_size, self.kv_dtype, self.device)
            peak = warm_up_peak(self.model, self.attn_layers, self.config.max_num_tokens, self.config.block_size,
                                self.kv_dtype, self.device)
            return gpu_blocks_that_fit(self.block_bytes, self.config.block_size, peak, self.device,
                                       self.config.kv_cache_fraction or 0.9, self.config.kv_cache_max_tokens)
        else:
            budget = _available_ram() * (self.config.kv_cache_fraction or 0.05)
        return max(1, int(budget // self.block_bytes))

    def host_inputs(self, batch: Batch, logit_rows: list[list[int]], pending: "PendingTokens | None" = None
                    ) -> "HostInputs":
        """The step's inputs as host arrays. logit_rows[i]: offsets within seq i's new tokens whose logits are wanted.
        pending: where the sequences whose newest token is still on the device (token_ids[-1] == PENDING) find it."""
        seqs, counts, bs = batch.seqs, batch.num_new_tokens, self.config.block_size
        tables = self.block_tables.gather(seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
        qsl = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        if batch.is_decode:
            input_ids = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, len(seqs))
            positions, rows_of_tokens = starts, np.arange(len(seqs))
        else:
            input_ids = np.fromiter(chain.from_iterable(s.token_ids[a:a + n] for s, a, n in
                                                        zip(seqs, starts.tolist(), counts)), np.int64, int(qsl[-1]))
            rows_of_tokens = np.repeat(np.arange(len(seqs)), counts)
            positions = np.arange(qsl[-1]) + np.repeat(starts - qsl[:-1], counts)
        slots = tables[rows_of_tokens, positions // bs].astype(np.int64) * bs + positions % bs
        ctx_lens = starts + counts
        if all(r == [0] for r in logit_rows):
            logits_indices = qsl[:-1]
        else:
            logits_indices = np.array([q + r for q, rows in zip(qsl.tolist(), logit_rows) for r in rows], np.int64)
        source = None
        if pending is not None:  # the newest token of sequence i is the last of its new tokens
            source = np.full(len(input_ids), -1, np.int64)
            source[qsl[1:] - 1] = pending.rows
        return HostInputs(input_ids, positions, slots, logits_indices, source, qsl.astype(np.int32),
                          ctx_lens.astype(np.int32), tables, batch.is_decode, list(counts), ctx_lens.tolist())

    def device_inputs(self, h: "HostInputs", pending: "PendingTokens | None") -> tuple[torch.Tensor, StepContext]:
        """A step's host arrays on the device in one copy, the tokens still on the device merged in."""
        ids, positions, slots, logits_indices, qsl, ctx_lens, tables, *source = self.upload(
            [h.input_ids, h.positions, h.slot_mapping, h.logits_indices, h.query_start_loc, h.context_lens,
             h.block_tables] + ([h.pending_source] if pending is not None else []))
        if pending is not None:
            ids = merge_pending(ids, source[0], pending.tokens)
        ctx = StepContext(positions=positions, slot_mapping=slots, query_start_loc=qsl, context_lens=ctx_lens,
                          block_tables=tables, logits_indices=logits_indices, is_decode=h.is_decode,
                          query_lens_cpu=h.query_lens_cpu, context_lens_cpu=h.context_lens_cpu)
        return ids, ctx

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """One host-to-device copy for several int64 / int32 arrays (through pinned memory on CUDA); device views,
        same shapes and dtypes. Each view starts on a 16-byte boundary: Triton specializes kernels on pointer
        alignment, so views at batch-dependent offsets would compile new variants mid-serving (~1 s each,
        benchmarks.md run 38)."""
        sizes = [-(-a.nbytes // UPLOAD_ALIGN_BYTES) * UPLOAD_ALIGN_BYTES for a in arrays]
        starts = np.cumsum([0] + sizes).tolist()
        host = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        flat_host = host.numpy()
        for a, start in zip(arrays, starts):
            flat_host[start:start + a.nbytes].view(a.dtype)[:] = a.ravel()
        flat = host.to(self.device, non_blocking=True)  # the pinned block is not reused before the copy is done
        return [flat[start:start + a.nbytes].view(_TORCH[a.dtype.type]).view(a.shape)
                for a, start in zip(arrays, starts)]

    @torch.inference_mode()
    def run(self, batch: Batch, logit_rows: list[list[int]], pending: "PendingTokens | None" = None
            ) -> torch.Tensor:
        """Computes the batch's new tokens (K/V into the cache); returns float32 logits [sum(len(rows)), V].
        Queues the work without waiting for the device."""
        host = self.host_inputs(batch, logit_rows, pending)
        if self.graphs is not None and self.graphs.can_run(host):
            return self.graphs.run(host, self.upload, pending)
        input_ids, ctx = self.device_inputs(host, pending)
        hidden = self.model(input_ids, ctx)
        if len(ctx.logits_indices) < len(input_ids):  # else every row, in order
            hidden = hidden[ctx.logits_indices]
        return self.model.compute_logits(hidden)


@dataclass
class HostInputs:
    """A step's inputs on the host (ModelRunner.host_inputs); StepContext's fields before the upload."""
    input_ids: np.ndarray  # [T] int64; PENDING where pending_source says where the token is
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    logits_indices: np.ndarray  # [R] int64
    pending_source: np.ndarray | None  # [T] int64: row of the previous step's samples holding the token, or -1
    query_start_loc: np.ndarray  # [B + 1] int32
    context_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, W] int32
    is_decode: bool
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]


@dataclass
class PendingTokens:
    """Input tokens that the previous step sampled and the host does not know yet."""
    tokens: torch.Tensor  # [S] int64 on the device: the previous step's sampled tokens
    rows: np.ndarray  # [len(batch.seqs)] int64: sequence i's newest token is tokens[rows[i]], or -1: on the host


class BlockTables:
    """The running sequences' block tables as one padded int32 array kept across steps: a row per sequence of the
    last step, into which a step writes only the blocks a sequence gained. Relies on BlockManager's contract that a
    held block_table only grows by append (a new allocation is a new list)."""

    def __init__(self, rows: int, cols: int, multiple: int = TABLE_WIDTH_MULTIPLE):
        self.array = np.zeros((rows, cols), np.int32)
        self.multiple = multiple  # the width handed out is a multiple of this
        self.free = list(range(rows - 1, -1, -1))  # rows held by no sequence, popped from the end
        self.entries: dict[int, list] = {}  # seq_id -> [row, the block_table list written from, blocks written]

    def gather(self, seqs: list) -> np.ndarray:
        """[len(seqs), longest table rounded up to `multiple`] int32, padded with 0. Sequences absent from this step
        give up their rows."""
        old, self.entries = self.entries, {}
        rows, width = [], 1
        for seq in seqs:
            entry = self.entries[seq.seq_id] = old.pop(seq.seq_id, None) or [self._free_row(), None, 0]
            row, table = entry[0], seq.block_table
            if entry[1] is not table:  # allocated anew (first step, or after a preemption)
                entry[1], entry[2] = table, 0
                self.array[row] = 0
            if entry[2] < len(table):
                self._write(row, table, entry[2])
                entry[2] = len(table)
            rows.append(row)
            width = max(width, len(table))
        self.free += [entry[0] for entry in old.values()]
        width = -(-width // self.multiple) * self.multiple
        if width > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, width - self.array.shape[1])))
        return self.array[rows, :width]

    def _write(self, row: int, table: list[int], start: int) -> None:
        if len(table) > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, len(table))))
        self.array[row, start:len(table)] = table[start:]

    def _free_row(self) -> int:
        if not self.free:
            n = len(self.array)
            self.array = np.pad(self.array, ((0, max(n, 1)), (0, 0)))
            self.free = list(range(len(self.array) - 1, n - 1, -1))
        return self.free.pop()


def _use_gpu_attention(on_cuda: bool) -> bool:
    """Installs the Triton attention backend for an engine on CUDA when Triton is there, else the torch one (the
    backend is process-wide: a CPU engine built after a GPU one must not keep the GPU kernels); returns whether the
    Triton backend is in."""
    from lowbit.kernels._triton import HAS_TRITON
    from lowbit.serve.attention import TorchAttentionBackend, set_attention_backend

    if not (on_cuda and HAS_TRITON):
        set_attention_backend(TorchAttentionBackend())
        return False
    from lowbit.serve.triton_attention import TritonAttentionBackend
    set_attention_backend(TritonAttentionBackend())
    return True


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")
