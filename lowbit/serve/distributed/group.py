"""The process group of one tensor-parallel engine: model collectives (NCCL on CUDA, gloo on the CPU) and a gloo
control group over which rank 0 broadcasts each step's inputs."""
from datetime import timedelta

import torch
import torch.distributed as dist

from lowbit.serve.distributed.sharding import Shard

# Model collectives: a peer that stops answering for this long ends the step with an error (the first steps on a GPU
# compile Triton kernels, which can take minutes).
COLLECTIVE_TIMEOUT_S = 600
# Control broadcasts: idle ranks wait here for the next step as long as the server is idle.
CONTROL_TIMEOUT = timedelta(days=30)


class TensorParallelGroup:
    """This process's rank in a tensor-parallel engine (one per process: torch.distributed's default group)."""

    def __init__(self, rank: int, world: int, device: torch.device, init_file: str):
        if dist.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; close() it first")
        self.shard, self.device = Shard(rank, world), device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    @property
    def rank(self) -> int:
        return self.shard.rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's t (row-parallel linears, the vocab-parallel embedding), in place."""
        dist.all_reduce(t)
        return t

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, V_local] on every rank -> [T, vocab_size]: the ranks' vocabulary slices side by side, padding dropped."""
        parts = [torch.empty_like(logits) for _ in range(self.shard.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def min(self, n: int) -> int:
        """The smallest n over the ranks (the KV pool every rank can hold)."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, message=None):
        """Rank 0 sends a picklable message to every rank; the others receive it (and pass None)."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
