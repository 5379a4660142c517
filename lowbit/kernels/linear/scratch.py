"""Per-device scratch buffers that CUDA graphs may point at: grown only outside graph capture, never freed."""
import torch

from lowbit.kernels._triton import next_pow2

_BUFFERS: dict = {}  # (name, device, dtype) -> {"buf": tensor, "retired": older, smaller buffers}


def grown(name: str, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
    """A buffer of at least numel elements for (name, device, dtype), the same one while it is large enough; None
    while a CUDA graph is being captured and it is too small (memory taken then would belong to the graph's pool).
    A buffer replaced by a larger one stays allocated: graphs captured earlier still point at it. Launches on one
    stream serialize, so one buffer serves every launch of its kernel."""
    s = _BUFFERS.get((name, device, dtype))
    if s is not None and s["buf"].numel() >= numel:
        return s["buf"]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if s is None:
        s = _BUFFERS[(name, device, dtype)] = {"buf": None, "retired": []}
    else:
        s["retired"].append(s["buf"])
    s["buf"] = torch.empty(next_pow2(numel), dtype=dtype, device=device)
    return s["buf"]
