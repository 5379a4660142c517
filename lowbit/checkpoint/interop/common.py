"""What the foreign-format readers share: the result type, on-disk tensor names and shapes, int4 unpacking."""
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lowbit import formats
from lowbit.errors import UserError


@dataclass
class Foreign:
    """A foreign checkpoint seen as lowbit's: `quant` is a MIXED_PRECISION quantization dict (every quantized linear
    listed with its lowbit quant_algo), `convert` maps the on-disk tensors to lowbit's names and layouts."""
    quant: dict
    convert: Callable[[dict], dict]


def is_float_dtype(dtype: str) -> bool:
    """A safetensors header dtype of an unquantized weight: F64, F32, F16 and its brain-float variant."""
    return dtype.removeprefix("B") in ("F64", "F32", "F16")


def tensor_headers(files: list[Path]) -> dict:
    """{tensor name: (shape tuple, safetensors dtype string)} of the safetensors files, from their headers only."""
    from safetensors import safe_open

    headers = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                headers[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return headers


def read_tensors(files: list[Path], names: set) -> dict:
    """The named tensors' values (small ones, needed to decide a layer's format at read time)."""
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if k in names})
    return out


def quant_dict(method: str, layers: dict, kv: formats.KVFormat | None = None) -> dict:
    """layers {module name: (Format, group size or None)} -> the quantization dict lowbit's readers resolve."""
    entries = {name: {"quant_algo": fmt.name, **({"group_size": g} if g else {})} for name, (fmt, g) in layers.items()}
    algos = sorted({e["quant_algo"] for e in entries.values()})
    return {"quant_algo": formats.MIXED_PRECISION, "quantized_layers": entries,
            "kv_cache_quant_algo": kv.name if kv else None, "source": {"quant_method": method, "quant_algos": algos}}


def take(tensors: dict, name: str, path) -> torch.Tensor:
    """Pops tensor `name`; a missing one is a UserError naming it."""
    if name not in tensors:
        raise UserError(f"{path}: tensor {name} is missing")
    return tensors.pop(name)


def check_shape(name: str, t: torch.Tensor, shape: tuple, path) -> None:
    if tuple(t.shape) != tuple(shape):
        raise UserError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype, path) -> None:
    if t.dtype != dtype:
        raise UserError(f"{path}: tensor {name} is {t.dtype}, expected {dtype}")


def unpack_nibbles(words: torch.Tensor, dim: int, order: tuple = tuple(range(8))) -> torch.Tensor:
    """int32 words holding 8 nibbles each, packed along `dim` -> uint8 nibbles (the packed dim 8x longer).

    order[j]: the nibble slot (bits 4*slot) that holds element 8*w + j of word w (natural order: slot j)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.tensor(order, dtype=torch.int64, device=w.device)
    w = w.movedim(dim, -1)
    u = ((w.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).flatten(-2)
    return u.movedim(-1, dim).contiguous()


def int4_tensors(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, name: str, path) -> dict:
    """q int [out, in] in [-8, 7], scale [out, groups], zero (same shape, or None) -> W4A16_AWQ / W4A16_ZP tensors."""
    if q.shape[0] % 2:
        raise UserError(f"{path}: {name} has {q.shape[0]} output rows; lowbit's int4 layout needs an even number")
    if q.shape[1] % scale.shape[1]:
        raise UserError(f"{path}: {name} has {q.shape[1]} inputs, not a multiple of its {scale.shape[1]} groups")
    t = {"weight": formats.pack_int4_rows(q.to(torch.int8)), "weight_scale": scale.float().contiguous()}
    if zero is not None:
        t["weight_zero_point"] = zero.to(torch.int8).contiguous()
    return t


def pack_nibbles(u: torch.Tensor, dim: int) -> torch.Tensor:
    """uint nibbles (values 0..15) -> int32 words of 8, packed along `dim` (zero-padded to a multiple of 8), element
    8*w + j at bits 4*j of word w: the inverse of unpack_nibbles in natural order."""
    u = u.to(torch.int64).movedim(dim, -1)
    pad = -u.shape[-1] % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(*u.shape[:-1], -1, 8)
    w = (u << (4 * torch.arange(8, dtype=torch.int64))).sum(-1)
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return w.movedim(-1, dim).contiguous()
