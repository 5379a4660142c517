"""Runs one scheduled step: flattens the batch into the model's inputs and the step context, returns logits."""
import torch

from lowbit.checkpoint import Checkpoint
from lowbit.serve.attention import Attention
from lowbit.serve.config import EngineConfig
from lowbit.serve.context import StepContext
from lowbit.serve.kv_pool import gpu_blocks_that_fit, warm_up_peak
from lowbit.serve.loader import load_model, model_dtype
from lowbit.serve.scheduler import Batch


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
        gpu_attention = self.device.type == "cuda" and _use_gpu_attention()
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        a = self.attn_layers[0]
        shape = (2, self.num_blocks, config.block_size, a.num_kv_heads, a.head_dim)
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.graphs = None
        if gpu_attention and config.cuda_graphs:
            self.graphs = self._capture_decode_graphs(ckpt.config)

    def _capture_decode_graphs(self, model_config: dict):
        from lowbit.serve.cuda_graphs import DecodeGraphs

        bs = self.config.block_size
        limits = [model_config.get("max_position_embeddings", 4096), self.num_blocks * bs, self.config.max_model_len]
        max_len = min(x for x in limits if x)
        graphs = DecodeGraphs(self.model, self.config.max_batch_size, -(-max_len // bs), self.device)
        graphs.capture()
        return graphs

    @property
    def block_bytes(self) -> int:
        per_token = sum(2 * m.num_kv_heads * m.head_dim for m in self.attn_layers)
        return per_token * self.config.block_size * torch.empty((), dtype=self.kv_dtype).element_size()

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            peak = warm_up_peak(self.model, self.attn_layers, self.config.max_num_tokens, self.config.block_size,
                                self.kv_dtype, self.device)
            return gpu_blocks_that_fit(self.block_bytes, self.config.block_size, peak, self.device,
                                       self.config.kv_cache_fraction or 0.9, self.config.kv_cache_max_tokens)
        else:
            budget = _available_ram() * (self.config.kv_cache_fraction or 0.05)
        return max(1, int(budget // self.block_bytes))

    def prepare(self, batch: Batch, logit_rows: list[list[int]]) -> tuple[torch.Tensor, StepContext]:
        """logit_rows[i]: offsets within seq i's new tokens whose logits are wanted."""
        bs = self.config.block_size
        input_ids, positions, slots, qsl, ctx_lens, logits_indices = [], [], [], [0], [], []
        for seq, n, rows in zip(batch.seqs, batch.num_new_tokens, logit_rows):
            start = seq.num_computed_tokens
            logits_indices += [qsl[-1] + r for r in rows]
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            qsl.append(qsl[-1] + n)
            ctx_lens.append(start + n)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        ctx = StepContext(positions=t(positions, torch.int64), slot_mapping=t(slots, torch.int64),
                          query_start_loc=t(qsl, torch.int32), context_lens=t(ctx_lens, torch.int32),
                          block_tables=t(tables, torch.int32), logits_indices=t(logits_indices, torch.int64),
                          is_decode=batch.is_decode, query_lens_cpu=list(batch.num_new_tokens),
                          context_lens_cpu=ctx_lens)
        return t(input_ids, torch.int64), ctx

    @torch.inference_mode()
    def run(self, batch: Batch, logit_rows: list[list[int]]) -> torch.Tensor:
        """Computes the batch's new tokens (K/V into the cache); returns float32 logits [sum(len(rows)), V]."""
        input_ids, ctx = self.prepare(batch, logit_rows)
        if self.graphs is not None and self.graphs.can_run(ctx) and all(r == [0] for r in logit_rows):
            return self.graphs.run(input_ids, ctx)
        hidden = self.model(input_ids, ctx)
        return self.model.compute_logits(hidden[ctx.logits_indices])


def _use_gpu_attention() -> bool:
    """Installs the Triton attention backend when Triton is there; returns whether it did."""
    from lowbit.kernels._triton import HAS_TRITON
    from lowbit.serve.attention import set_attention_backend
    from lowbit.serve.triton_attention import TritonAttentionBackend

    if HAS_TRITON:
        set_attention_backend(TritonAttentionBackend())
    return HAS_TRITON


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")
