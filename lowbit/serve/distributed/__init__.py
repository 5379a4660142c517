"""Tensor parallelism on torch.distributed: one process per rank, rank 0 schedules and samples, every rank runs its
shard of the model (gloo on the CPU, NCCL on CUDA)."""
