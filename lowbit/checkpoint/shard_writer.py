"""Streaming safetensors writer: tensors in, model-0000k-of-0000n.safetensors + index out, one tensor in memory.

safetensors puts a JSON header (names, dtypes, shapes, byte offsets) before the data, so a shard's data goes to a
scratch file as tensors arrive and the header is written in front of it when the shard closes.
"""
import functools
import json
import shutil
import struct
from pathlib import Path

import torch

from lowbit.checkpoint.io import SHARD_INDEX

@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype (F32, F8_E4M3, ...), read from the header it writes for an empty tensor."""
    from safetensors.torch import save

    blob = save({"t": torch.empty(0, dtype=dtype)})
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length])["t"]["dtype"]


class ShardWriter:
    """Writes tensors into `out` in shards of at most `max_bytes` of data (a larger tensor gets a shard of its own).
    close() names them model.safetensors (one shard) or model-0000k-of-0000n.safetensors + the index."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = Path(out), max_bytes
        self.shards: list[Path] = []  # closed shards, numbered in order
        self.weight_map: dict[str, int] = {}  # tensor name -> shard number
        self.total = 0
        self._open()

    def _open(self) -> None:
        self.entries, self.size = {}, 0
        self.data = open(self.out / f".shard-{len(self.shards)}.data", "wb")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_rows(name, tensor.shape, tensor.dtype, [tensor])

    def add_rows(self, name: str, shape, dtype: torch.dtype, chunks) -> None:
        """One tensor of `shape` and `dtype` from consecutive row slices (any dtype; cast as they are written)."""
        if name in self.weight_map:
            raise ValueError(f"tensor {name} written twice")
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if self.size and self.size + nbytes > self.max_bytes:
            self._close_shard()
            self._open()
        written = 0
        for chunk in chunks:
            t = chunk.detach().to("cpu", dtype).contiguous()
            self.data.write(t.reshape(-1).view(torch.uint8).numpy().data)
            written += t.numel() * t.element_size()
        if written != nbytes:
            raise ValueError(f"{name}: {written} bytes written for shape {list(shape)} of {dtype}")
        self.entries[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                              "data_offsets": [self.size, self.size + nbytes]}
        self.size += nbytes
        self.total += nbytes
        self.weight_map[name] = len(self.shards)

    def _close_shard(self) -> None:
        self.data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        path = self.out / f".shard-{len(self.shards)}.safetensors"
        with open(path, "wb") as f, open(self.data.name, "rb") as data:
            f.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, f, 16 << 20)
        Path(self.data.name).unlink()
        self.shards.append(path)

    def close(self) -> list[Path]:
        """Closes the last shard and gives every shard its final name; returns the files."""
        self._close_shard()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        for tmp, name in zip(self.shards, names):
            tmp.rename(self.out / name)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {t: names[k] for t, k in sorted(self.weight_map.items())}}
            (self.out / SHARD_INDEX).write_text(json.dumps(index, indent=2))
        return [self.out / name for name in names]
