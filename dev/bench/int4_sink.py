"""AWQ-lite's activation statistics without each sequence's first token (SmolLM2's attention sink), for
dev/bench/int4_levers.py: while calibrate() runs, its first forward pass (modelopt's statistics pass) also records
each linear's mean |x| over every token but the first of each sequence, and the second (the scale search) starts
with modelopt's act_scale replaced by it. The search's loss and the clip search still see every token."""
import contextlib

import torch

from lowbit.calibrate import loop as calib_loop


@contextlib.contextmanager
def sink_free_act_scale(skip_first: int = 1):
    original = calib_loop.forward_loop

    def patched(batches, desc="calibrating", later_passes="pass"):
        inner = original(batches, desc, later_passes)
        calls, sums, counts = [0], {}, {}

        def record(mod, args):
            x = args[0]
            x = x[:, skip_first:] if x.dim() == 3 else x
            x = x.reshape(-1, x.shape[-1]).abs().float()
            sums[mod] = sums.get(mod, 0) + x.sum(0)
            counts[mod] = counts.get(mod, 0) + x.shape[0]

        def run(model):
            calls[0] += 1
            awq = [m for m in model.modules() if hasattr(m, "awq_lite")]
            if calls[0] == 1:
                hooks = [m.register_forward_pre_hook(record) for m in awq]
                try:
                    return inner(model)
                finally:
                    for h in hooks:
                        h.remove()
            if calls[0] == 2:
                for m in awq:
                    if m in sums and torch.is_tensor(m.awq_lite.act_scale):
                        m.awq_lite.act_scale = sums[m] / counts[m]
            return inner(model)
        return run

    calib_loop.forward_loop = patched
    try:
        yield
    finally:
        calib_loop.forward_loop = original
