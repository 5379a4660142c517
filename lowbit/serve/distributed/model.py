"""One rank's model: the vocab-parallel embedding, the all-reduce after row-parallel linears, the logits gather
after lm_head, and the rank's slice of each checkpoint tensor as the loader reads it."""
from functools import partial

import torch
from torch import nn

from lowbit.serve.distributed.group import TensorParallelGroup
from lowbit.serve.distributed.sharding import ROW, cdiv, shard_linear, shard_vocab_rows
from lowbit.serve.layers.linear import Linear


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the embedding table; ids outside them embed to zeros, and the all-reduce
    over the ranks leaves each id's one row (exact: one non-zero addend)."""

    def __init__(self, rows: int, hidden: int, group: TensorParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)
        self.start, self.group = group.rank * rows, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(emb.masked_fill(outside[:, None], 0))


def parallelize(model: nn.Module, group: TensorParallelGroup, config: dict) -> None:
    """Wires a model built from local_config(config) for its rank: config is the full model's."""
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear) and leaf in ROW:
            module.combine = group.all_reduce
        elif isinstance(module, Linear) and leaf == "lm_head":
            module.combine = partial(group.gather_vocab, vocab_size=config["vocab_size"])
        elif isinstance(module, nn.Embedding) and leaf == "embed_tokens":
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            rows = cdiv(config["vocab_size"], group.shard.world)
            setattr(parent, leaf, VocabParallelEmbedding(rows, config["hidden_size"], group))
    model.config = config  # the engine reads the full vocabulary size


def shard_param(group: TensorParallelGroup, name: str, t: torch.Tensor) -> torch.Tensor:
    """A plain parameter's slice: the embedding's vocabulary rows; norms are replicated."""
    return shard_vocab_rows(name, t, group.shard) if name.endswith("embed_tokens.weight") else t


def shard_linear_tensors(group: TensorParallelGroup, config: dict, name: str, algo, tensors: dict) -> dict:
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    return shard_linear(name, algo, tensors, group.shard, kv)
