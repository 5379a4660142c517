"""Dummy int4 weights in other checkpoints' W4A16 layouts, read back by lowbit's own interop readers one linear at a
time: the repack a compressed-tensors, GPTQ or AutoAWQ checkpoint goes through at load, on the same codes and scales.

Every layout starts from the same W4A16_AWQ tensors with fp16-exact scales (GPTQ and AutoAWQ store fp16 scales), so
all four serve the same weights: compressed-tensors pack-quantized and GPTQ (sym, v1, g_idx in order) read back as
W4A16_AWQ, AutoAWQ GEMM (zero points of 8 on disk) as W4A16_ZP with zero points 0.
"""
import torch

from lowbit import formats
from lowbit.checkpoint.interop import autoawq, compressed_tensors, gptq

LAYOUTS = ("modelopt", "compressed-tensors", "gptq", "autoawq")
SOURCE = "dummy"  # the path the readers name in an error
AWQ_SLOTS = tuple(autoawq.ORDER.index(i) for i in range(8))  # AutoAWQ: word slot i holds element AWQ_SLOTS[i]


def served_algo(layout: str) -> str:
    """The quant_algo lowbit's reader gives a layer of this layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    return formats.W4A16_ZP.name if layout == "autoawq" else formats.W4A16_AWQ.name


def _pack(u: torch.Tensor, dim: int, slots: tuple = tuple(range(8))) -> torch.Tensor:
    """Nibbles (0..15) -> int32 words of 8 along `dim` (a multiple of 8), word slot i (bits 4*i) holding element
    slots[i] of its 8: the inverse of interop.common.unpack_nibbles."""
    u = u.to(torch.int64).movedim(dim, -1)
    u = u.reshape(*u.shape[:-1], -1, 8)[..., list(slots)]
    w = (u << (4 * torch.arange(8, dtype=torch.int64, device=u.device))).sum(-1)
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.movedim(-1, dim).contiguous()


def int4_codes(w: torch.Tensor, group: int = 128) -> dict:
    """A float weight [out, in] -> W4A16_AWQ tensors whose scales are fp16-exact (the codes rounded with them)."""
    scale = formats.W4A16_AWQ.quantize(w, group=group)["weight_scale"].half()  # [out, groups]
    q = (w.float() / scale.float().repeat_interleave(group, 1)).round().clamp(-8, 7)  # [out, in]
    return {"weight": formats.pack_int4_rows(q.to(torch.int8)), "weight_scale": scale.float()}


def to_layout(layout: str, module: str, t: dict) -> dict:
    """W4A16_AWQ tensors of one linear -> its tensors on disk in `layout` (full names)."""
    if layout == "modelopt":
        return {f"{module}.{k}": v for k, v in t.items()}
    u = formats.unpack_int4_rows(t["weight"]).to(torch.int64) + 8  # [out, in] in [0, 15]
    (out, inp), scale = u.shape, t["weight_scale"].half()  # [out, groups]
    groups, dev = scale.shape[1], u.device
    if layout == "compressed-tensors":
        return {f"{module}.weight_packed": _pack(u, 1), f"{module}.weight_scale": scale,
                f"{module}.weight_shape": torch.tensor([out, inp])}
    if layout == "gptq":  # v1: zero points stored minus 1
        return {f"{module}.qweight": _pack(u.t(), 0), f"{module}.scales": scale.t().contiguous(),
                f"{module}.qzeros": _pack(torch.full((groups, out), 7, device=dev), 1),
                f"{module}.g_idx": (torch.arange(inp, device=dev) // (inp // groups)).to(torch.int32)}
    return {f"{module}.qweight": _pack(u.t(), 1, AWQ_SLOTS), f"{module}.scales": scale.t().contiguous(),
            f"{module}.qzeros": _pack(torch.full((groups, out), 8, device=dev), 1, AWQ_SLOTS)}


def read_layout(layout: str, module: str, disk: dict) -> dict:
    """One linear's tensors on disk in `layout` -> lowbit's tensors (suffix -> tensor), by that layout's reader."""
    if layout == "modelopt":
        return {k.rsplit(".", 1)[1]: v for k, v in disk.items()}
    if layout == "compressed-tensors":
        group = disk[f"{module}.weight_shape"][1].item() // disk[f"{module}.weight_scale"].shape[1]
        out = compressed_tensors.convert(SOURCE, {module: (formats.W4A16_AWQ, group, None)}, None, dict(disk))
    elif layout == "gptq":
        out = gptq.convert(SOURCE, {module: True}, True, 1, disk)
    else:
        disk = dict(disk)
        return autoawq.linear_tensors(SOURCE, module, *(disk.pop(f"{module}.{s}") for s in ("qweight", "qzeros",
                                                                                              "scales")))
    return {k.rsplit(".", 1)[1]: v for k, v in out.items()}


def through_layout(layout: str, module: str, w: torch.Tensor, group: int = 128) -> dict:
    """A float weight [out, in] -> int4_codes, written in `layout` and read back: the lowbit tensors it serves."""
    return read_layout(layout, module, to_layout(layout, module, int4_codes(w, group)))


__all__ = ["LAYOUTS", "served_algo", "int4_codes", "to_layout", "read_layout", "through_layout"]
