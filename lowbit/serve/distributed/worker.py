"""A tensor-parallel rank other than 0: loads its shard, then runs every step rank 0 broadcasts until told to stop."""
import os
import sys
import threading
import time
from dataclasses import replace

import torch

from lowbit import checkpoint
from lowbit.serve.distributed.group import TensorParallelGroup
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.runner.model_runner import ModelRunner

STOP = None  # the message that ends the loop
PARENT_POLL_S = 0.5


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:rank on a GPU engine, else the CPU."""
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(f"cuda:{rank}") if torch.device(device).type == "cuda" else torch.device("cpu")


def main(rank: int, world: int, source, config: EngineConfig, init_file: str, errors) -> None:
    """source: a Checkpoint (picklable: no converter) or a checkpoint path. errors: a queue for rank 0, which
    reports a rank's failure; the rank then exits 1."""
    _exit_with_parent(os.getppid())
    try:
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = TensorParallelGroup(rank, world, device, init_file)
        ckpt = source if isinstance(source, checkpoint.Checkpoint) else checkpoint.read(source)
        runner = ModelRunner(ckpt, replace(config, device=str(device)), tp=group)
        serve(runner, group)
    except Exception as e:  # reported by rank 0 as this rank's failure
        errors.put((rank, f"{type(e).__name__}: {e}"))
        sys.exit(1)
    group.close()


def serve(runner: ModelRunner, group: TensorParallelGroup) -> None:
    """Each message: ("moves", BlockMoves) or ("step", HostInputs); the logits gather is the step's last collective."""
    while (message := group.broadcast()) is not STOP:
        kind, payload = message
        if kind == "moves":
            runner.move_blocks(payload)
        else:
            runner.run_host(payload)


def _exit_with_parent(parent: int) -> None:
    """A rank whose rank 0 is gone exits at once, even while blocked in a collective (NCCL would wait for its
    timeout)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="lowbit-tp-parent").start()
