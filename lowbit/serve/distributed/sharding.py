"""Which slice of each checkpoint tensor a tensor-parallel rank holds, and the per-rank model config."""
from dataclasses import dataclass

import torch

from lowbit import formats

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split across ranks
ROW = ("o_proj", "down_proj")  # input features split; the ranks' partial outputs are summed (all-reduce)
KV = ("k_proj", "v_proj")  # split by KV head, replicated when there are fewer KV heads than ranks
VOCAB = ("lm_head", "embed_tokens")  # vocabulary rows split; padded with zero rows to a multiple of the ranks


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_pieces(num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    """(pieces the K/V rows are cut into, the piece this rank holds): one piece per rank, or with fewer KV heads than
    ranks one head per piece, rank r holding head r * Hk // world (each head on world / Hk ranks)."""
    if num_kv_heads >= shard.world:
        return shard.world, shard.rank
    return num_kv_heads, shard.rank * num_kv_heads // shard.world


def local_config(config: dict, world: int) -> dict:
    """The HF config of one rank's model: its heads, intermediate size and vocabulary rows; ValueError (one line)
    for a world size that does not divide them."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    if heads % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide num_attention_heads {heads}")
    if (kv % world if kv >= world else world % kv):
        raise ValueError(f"tensor_parallel_size {world} and num_key_value_heads {kv}: one must divide the other")
    if inter % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide intermediate_size {inter}")
    return dict(config, num_attention_heads=heads // world, num_key_value_heads=max(1, kv // world),
                head_dim=config.get("head_dim") or config["hidden_size"] // heads, intermediate_size=inter // world,
                vocab_size=cdiv(config["vocab_size"], world))


def shard_linear(name: str, algo, tensors: dict, shard: Shard, num_kv_heads: int) -> dict:
    """One rank's tensors of the checkpoint linear `name` (its full tensors by on-disk suffix), by the format's
    shard_dims. A row-parallel bias is added once: ranks other than 0 get zeros."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in COLUMN or leaf in VOCAB:
        axis, (pieces, index) = 0, kv_pieces(num_kv_heads, shard) if leaf in KV else (shard.world, shard.rank)
    elif leaf in ROW:
        axis, pieces, index = 1, shard.world, shard.rank
    else:
        return tensors
    dims = formats.get(algo).shard_dims
    out = {}
    for suffix, t in tensors.items():
        dim = dims[suffix][axis]
        if suffix == "bias" and leaf in ROW:
            out[suffix] = t if shard.rank == 0 else torch.zeros_like(t)
        elif dim is None or t.numel() == 1:
            out[suffix] = t
        else:
            if leaf in VOCAB and algo is None:
                t = pad_rows(t, cdiv(t.shape[0], pieces) * pieces)
            out[suffix] = split(t, dim, pieces, index, f"{name}.{suffix}", axis)
    return out


def shard_vocab_rows(name: str, t: torch.Tensor, shard: Shard) -> torch.Tensor:
    """An embedding table [V, hidden] -> this rank's rows [ceil(V / world), hidden] (zero rows past V)."""
    t = pad_rows(t, cdiv(t.shape[0], shard.world) * shard.world)
    return split(t, 0, shard.world, shard.rank, name, 0)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def split(t: torch.Tensor, dim: int, pieces: int, index: int, name: str, axis: int) -> torch.Tensor:
    """Piece `index` of `pieces` equal slices of t along dim (a copy: the full tensor can be freed)."""
    size = t.shape[dim]
    if size % pieces:
        what = "output rows" if axis == 0 else "input features"
        raise ValueError(f"tensor parallelism cannot cut {name} into {pieces} equal parts: it has {size} entries "
                         f"along its {what} (packed 4-bit rows and quantization groups never straddle two ranks)")
    n = size // pieces
    return t.narrow(dim, index * n, n).clone(memory_format=torch.contiguous_format)
