"""Runs one scheduled step: flattens the batch into the model's inputs and the step context, returns logits."""
from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np
import torch

from lowbit.checkpoint import Checkpoint
from lowbit.kernels import merge_pending
from lowbit.progress import note, stage
from lowbit.serve.layers.attention import Attention
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.runner.block_tables import TABLE_WIDTH_MULTIPLE, BlockTables
from lowbit.serve.runner.context import StepContext
from lowbit.serve.runner.host_cache import HostCache
from lowbit.serve.runner.kv_cache import KvPartner, allocate_kv_cache, assign_kv_kinds
from lowbit.serve.runner.loader import load_model, model_dtype
from lowbit.serve.engine.host_pool import BlockMoves
from lowbit.serve.engine.scheduler import Batch

_TORCH = {np.int64: torch.int64, np.int32: torch.int32}  # upload's dtypes
UPLOAD_ALIGN_BYTES = 16


class ModelRunner:
    def __init__(self, ckpt: Checkpoint, config: EngineConfig, tp=None, kv_partner: "ModelRunner | None" = None,
                 split_kv_kinds: bool = True):
        """tp: this process's TensorParallelGroup: the runner holds its rank's shard (lowbit.serve.distributed).
        kv_partner: a draft model's runner on the same device (loaded, its pool not yet sized): both pools get the
        same number of blocks out of one budget, and the partner's pool is allocated here (`adopt_kv`).
        split_kv_kinds: a model with full and windowed layers gets a KV pool per layer kind (kv_cache.py
        `assign_kv_kinds`), unless tensor parallelism, a host KV cache or a draft model is in (or it is one)."""
        self.config = config
        self.model_config = ckpt.config
        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.dtype = model_dtype(ckpt, config.dtype)
        with stage(f"loading weights from {ckpt.path} onto {self.device}"):
            self.model = load_model(ckpt, self.device, self.dtype, tp)
        kv = ckpt.kv_format  # a ValueError for an unknown kv_cache_quant_algo
        self.kv_dtype = kv.cache_dtype if kv is not None else self.dtype
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        host_cache = config.host_cache_size and config.enable_prefix_caching
        split = split_kv_kinds and tp is None and kv_partner is None and not host_cache
        self.kv_windows = assign_kv_kinds(self.attn_layers, split)  # per kind: blocks before its window are freed
        self.sliding_window = self.kv_windows[0] if len(self.kv_windows) == 1 else None  # every layer windowed
        if split_kv_kinds and not split and {m.sliding_window is None for m in self.attn_layers} == {True, False}:
            note("full and windowed attention layers share one KV pool (tensor parallelism, a host KV cache or a "
                 "draft model is on): the windowed layers hold the whole context")
        gpu_attention = self.gpu_attention = _use_gpu_attention(self.device.type == "cuda")
        bs = config.block_size
        if gpu_attention and self.kv_dtype == torch.float8_e4m3fn and bs & (bs - 1):
            raise ValueError(f"block_size {bs}: an FP8 KV cache on the GPU needs a power of two (its V is read "
                             f"block by block)")
        with stage("warm-up and KV cache" if self.device.type == "cuda" else "KV cache"):
            partner = None if kv_partner is None else \
                KvPartner(kv_partner.model, kv_partner.attn_layers, kv_partner.kv_dtype)
            self.kv_blocks = allocate_kv_cache(self.model, self.attn_layers, config, self.kv_dtype, self.device,
                                               partner, self.kv_windows)
            agreed = self.kv_blocks[0] if tp is None else tp.min(self.kv_blocks[0])  # every rank: the same pool
            if agreed < self.kv_blocks[0]:  # one kind with tp
                self.kv_blocks = allocate_kv_cache(self.model, self.attn_layers, replace(config, num_kv_blocks=agreed),
                                                   self.kv_dtype, self.device)
            self.num_blocks = self.kv_blocks[0]
            if len(self.kv_blocks) > 1:
                note(f"KV pools: {self.kv_blocks[0]} blocks for the full-attention layers, {self.kv_blocks[1]} for "
                     f"the windowed ones (window {self.kv_windows[1]})")
        if kv_partner is not None:
            kv_partner.adopt_kv(self.num_blocks, config.cuda_graphs)
        self.host_cache = None  # evicted prefix blocks in host memory (config.host_cache_size)
        if config.host_cache_size and config.enable_prefix_caching:  # it holds prefix-cache blocks only
            with stage("host KV cache"):
                self.host_cache = HostCache.sized([m.kv_cache for m in self.attn_layers], config.host_cache_size)
        self.block_tables = [BlockTables(config.max_batch_size, 64, kind=k) for k in range(len(self.kv_blocks))]
        self.graphs = self.verify_graphs = None
        if gpu_attention and config.cuda_graphs and tp is None:
            with stage("capturing decode CUDA graphs"):
                self.graphs = self._capture_decode_graphs(ckpt.config)
            # the verify step: k + 1 tokens per sequence, k <= num_draft_tokens; its graphs hold one block table,
            # so a model with a KV pool per layer kind verifies eagerly
            if config.speculative is not None and len(self.kv_blocks) == 1:
                with stage("capturing verify CUDA graphs"):
                    self.verify_graphs = self.capture_verify_graphs(range(2, config.num_draft_tokens + 2))

    def _capture_decode_graphs(self, model_config: dict):
        from lowbit.serve.runner.cuda_graphs import DecodeGraphs

        bs = self.config.block_size
        limits = [model_config.get("max_position_embeddings", 4096), self.num_blocks * bs, self.config.max_model_len]
        max_len = min(x for x in limits if x)
        max_blocks = -(-max_len // bs)
        width = -(-max_blocks // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE  # as wide as any table handed out
        num_kv_heads = model_config.get("num_key_value_heads") or model_config["num_attention_heads"]
        graphs = DecodeGraphs(self.model, self.config.max_batch_size, width, num_kv_heads, self.device,
                              num_kinds=len(self.kv_blocks))
        graphs.capture()
        return graphs

    def capture_verify_graphs(self, tokens):
        """Multi-token steps of q in tokens new tokens per sequence, up to the speculative batch size, in the decode
        graphs' memory pool (runner/verify_graphs.py)."""
        from lowbit.serve.runner.verify_graphs import VerifyGraphs

        max_batch = min(self.config.max_batch_size, self.config.speculative_max_batch_size)
        graphs = VerifyGraphs(self.model, max_batch, tokens, self.graphs.block_tables.shape[1], self.config.block_size,
                              self.device)
        graphs.capture(self.graphs.pool)
        return graphs

    def adopt_kv(self, num_blocks: int, cuda_graphs: bool) -> None:
        """A draft model's runner, built with a placeholder pool and no graphs: its pool of num_blocks blocks (sized
        with its target's, `kv_partner`), then its decode graphs and 2-token catch-up graphs when cuda_graphs and the
        GPU allow them."""
        self.config = replace(self.config, num_kv_blocks=num_blocks, cuda_graphs=cuda_graphs)
        self.kv_blocks = allocate_kv_cache(self.model, self.attn_layers, self.config, self.kv_dtype, self.device,
                                           windows=self.kv_windows)
        self.num_blocks = self.kv_blocks[0]
        if self.gpu_attention and cuda_graphs:
            with stage("capturing the draft model's decode CUDA graphs"):
                self.graphs = self._capture_decode_graphs(self.model_config)
            with stage("capturing the draft model's catch-up CUDA graphs"):  # after a verify step: 1-2 tokens each
                self.verify_graphs = self.capture_verify_graphs((2,))

    def close(self) -> None:
        """Nothing to stop: one process (the tensor-parallel runner stops its ranks here)."""

    @property
    def num_host_blocks(self) -> int:
        return self.host_cache.num_slots if self.host_cache is not None else 0

    def move_blocks(self, moves: "BlockMoves | None") -> None:
        """Copies a step's blocks to and from the host pool, queued before the step's forward."""
        if moves:
            self.host_cache.apply(moves)

    def host_inputs(self, batch: Batch, logit_rows: list[list[int]], pending: "PendingTokens | None" = None
                    ) -> "HostInputs":
        """The step's inputs as host arrays. logit_rows[i]: offsets within seq i's new tokens whose logits are wanted.
        pending: where the sequences whose newest token is still on the device (token_ids[-1] == PENDING) find it."""
        seqs, counts, bs = batch.seqs, batch.num_new_tokens, self.config.block_size
        tables, *kind_tables = (t.gather(seqs) for t in self.block_tables)
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
        slots, *kind_slots = (t[rows_of_tokens, positions // bs].astype(np.int64) * bs + positions % bs
                              for t in [tables] + kind_tables)
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
                          ctx_lens.astype(np.int32), tables, batch.is_decode, list(counts), ctx_lens.tolist(),
                          list(zip(kind_slots, kind_tables)))

    def device_inputs(self, h: "HostInputs", pending: "PendingTokens | None") -> tuple[torch.Tensor, StepContext]:
        """A step's host arrays on the device in one copy, the tokens still on the device merged in."""
        kinds = list(chain.from_iterable(h.kinds))
        ids, positions, slots, logits_indices, qsl, ctx_lens, tables, *rest = self.upload(
            [h.input_ids, h.positions, h.slot_mapping, h.logits_indices, h.query_start_loc, h.context_lens,
             h.block_tables] + kinds + ([h.pending_source] if pending is not None else []))
        if pending is not None:
            ids = merge_pending(ids, rest[-1], pending.tokens)
        ctx = StepContext(positions=positions, slot_mapping=slots, query_start_loc=qsl, context_lens=ctx_lens,
                          block_tables=tables, logits_indices=logits_indices, is_decode=h.is_decode,
                          query_lens_cpu=h.query_lens_cpu, context_lens_cpu=h.context_lens_cpu)
        return ids, ctx.with_kinds([(rest[i], rest[i + 1]) for i in range(0, len(kinds), 2)])

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """One host-to-device copy for several int64 / int32 arrays (through pinned memory on CUDA); device views,
        same shapes and dtypes. Each view starts on a 16-byte boundary: Triton specializes kernels on pointer
        alignment, so views at batch-dependent offsets would compile new variants mid-serving (~1 s each)."""
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
        return self.run_host(self.host_inputs(batch, logit_rows, pending), pending)

    @torch.inference_mode()
    def run_host(self, host: "HostInputs", pending: "PendingTokens | None" = None) -> torch.Tensor:
        """run() from the step's host arrays (a tensor-parallel rank gets them from rank 0)."""
        if self.graphs is not None and self.graphs.can_run(host):
            return self.graphs.run(host, self.upload, pending)
        if self.verify_graphs is not None and self.verify_graphs.can_run(host):
            return self.verify_graphs.run(host, self.upload, pending)
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
    kinds: list = field(default_factory=list)  # per layer kind after kind 0: (slot_mapping [T] int64, tables [B, W'])


@dataclass
class PendingTokens:
    """Input tokens that the previous step sampled and the host does not know yet."""
    tokens: torch.Tensor  # [S] int64 on the device: the previous step's sampled tokens
    rows: np.ndarray  # [len(batch.seqs)] int64: sequence i's newest token is tokens[rows[i]], or -1: on the host


def _use_gpu_attention(on_cuda: bool) -> bool:
    """Installs the Triton attention backend for an engine on CUDA when Triton is there, else the torch one (the
    backend is process-wide: a CPU engine built after a GPU one must not keep the GPU kernels); returns whether the
    Triton backend is in."""
    from lowbit.kernels import HAS_TRITON
    from lowbit.serve.layers.attention import TorchAttentionBackend, set_attention_backend

    if not (on_cuda and HAS_TRITON):
        set_attention_backend(TorchAttentionBackend())
        return False
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend
    set_attention_backend(TritonAttentionBackend())
    return True
