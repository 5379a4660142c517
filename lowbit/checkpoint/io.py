"""Reading checkpoint directories, and writing them atomically (temporary directory, then rename)."""
import hashlib
import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Callable

import yaml

from lowbit import formats
from lowbit.errors import UserError

QUANT_CONFIG = "hf_quant_config.json"
RECIPE_FILE = "recipe.yaml"
MANIFEST = "lowbit_manifest.json"
SHARD_INDEX = "model.safetensors.index.json"  # HF's index of a sharded checkpoint: {"weight_map": {tensor: file}}


@dataclass
class Checkpoint:
    path: Path
    config: dict  # config.json
    quant: dict | None  # hf_quant_config.json["quantization"]; None for an unquantized model
    recipe: dict | None  # recipe.yaml, when lowbit wrote the checkpoint
    manifest: dict | None
    convert: Callable[[dict], dict] | None = None  # a foreign format's tensors -> lowbit's (lowbit.checkpoint.interop)

    @property
    def quant_algo(self) -> str | None:
        return self.quant.get("quant_algo") if self.quant else None

    @property
    def kv_algo(self) -> str | None:
        return self.quant.get("kv_cache_quant_algo") if self.quant else None

    @property
    def kv_format(self) -> formats.KVFormat | None:
        """The KV cache's format, None for a cache in the model dtype (an unknown one is a ValueError)."""
        return formats.kv_format(self.kv_algo)

    def layer_algo(self, module_name: str) -> str | None:
        """The quant_algo of one linear module, or None when it is excluded (left in float)."""
        return formats.layer_algo(self.quant, module_name)

    def layer_format(self, module_name: str) -> formats.Format | None:
        """The Format of one linear module, or None when it is excluded (left in float)."""
        return formats.layer_format(self.quant, module_name)

    @cached_property
    def weight_files(self) -> list[Path]:
        """The shards the index names (every one must exist), else every *.safetensors file."""
        index = self.path / SHARD_INDEX
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise UserError(f"{index} names shard {missing[0]}, which is not in {self.path}")
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.path} holds no .safetensors files")
        return files

    def tensors(self, device: str = "cpu", lazy: bool = False) -> Mapping:
        """Every tensor by name. lazy: a read-only mapping that reads each tensor from its shard when asked for,
        so a caller that keeps one tensor at a time holds one in host memory, not the model (a foreign format's
        conversion needs them all: it is read eagerly)."""
        if lazy and self.convert is None:
            return LazyTensors(self.weight_files, device)
        from safetensors.torch import load_file

        out = {}
        for f in self.weight_files:
            out.update(load_file(f, device=device))
        return out if self.convert is None else self.convert(out)


class LazyTensors(Mapping):
    """name -> tensor, read from its safetensors file at each access (only the headers are read up front).
    Each access maps its file anew and the tensor alone keeps the mapping, so the host holds the tensors the caller
    keeps, not every shard it has touched."""

    def __init__(self, files: list[Path], device: str = "cpu"):
        from safetensors import safe_open

        self.device = device
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(f, framework="pt") as handle:
                for name in handle.keys():
                    if name in self._where:
                        raise UserError(f"tensor {name} is in both {self._where[name].name} and {f.name}")
                    self._where[name] = f

    def __getitem__(self, name: str):
        from safetensors import safe_open

        with safe_open(self._where[name], framework="pt", device=self.device) as handle:
            return handle.get_tensor(name)

    def shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(self._where[name], framework="pt") as handle:
            return handle.get_slice(name).get_shape()

    def row_chunks(self, name: str, max_bytes: int = 32 << 20):
        """The tensor in slices of whole rows (dim 0) of at most ~max_bytes each (as float32). Each slice maps the
        file anew, so the pages of the slices already read do not stay resident."""
        from safetensors import safe_open

        shape = self.shape(name)
        if len(shape) < 2:
            yield self[name]
            return
        step = max(1, max_bytes // (math.prod(shape[1:]) * 4))
        for start in range(0, shape[0], step):
            with safe_open(self._where[name], framework="pt", device=self.device) as handle:
                yield handle.get_slice(name)[start:start + step]

    def __contains__(self, name) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read(path) -> Checkpoint:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a checkpoint directory (no config.json)")
    config = json.loads((path / "config.json").read_text())
    quant = None
    if (path / QUANT_CONFIG).is_file():
        quant = json.loads((path / QUANT_CONFIG).read_text())["quantization"]
    elif config.get("quantization_config", {}).get("quant_method") == "modelopt":
        quant = config["quantization_config"]
    elif "quantization_config" in config:
        return _read_foreign(path, config)
    recipe = yaml.safe_load((path / RECIPE_FILE).read_text()) if (path / RECIPE_FILE).is_file() else None
    manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else None
    return Checkpoint(path, config, quant, recipe, manifest)


def _read_foreign(path: Path, config: dict) -> Checkpoint:
    """compressed-tensors, AutoAWQ and GPTQ checkpoints, seen through lowbit's formats (lowbit.checkpoint.interop)."""
    from lowbit.checkpoint import interop

    ckpt = Checkpoint(path, config, None, None, None)
    foreign = interop.read(path, config, ckpt.weight_files)
    if foreign is None:
        method = config["quantization_config"].get("quant_method")
        raise UserError(f"{path}: quant_method {method!r} is not read by lowbit "
                        f"(modelopt, {', '.join(sorted(interop.READERS))})")
    ckpt.quant, ckpt.convert = foreign.quant, foreign.convert
    return ckpt


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, info: dict) -> None:
    files = {p.name: sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({**info, "files": files}, indent=2) + "\n")


def current_umask() -> int:
    """The process umask (read by setting it and setting it back: os has no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask_modes(root: Path) -> None:
    """Gives `root` and everything under it the modes a plain mkdir / open would have under the current umask
    (dirs 0o777 & ~umask, files 0o666 & ~umask, executables 0o777 & ~umask). tempfile.mkdtemp / mkstemp make
    0o700 / 0o600, which would keep other users and containers of another uid out of the store."""
    mask = current_umask()
    root.chmod(0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask, follow_symlinks=False)
        for f in filenames:
            path = os.path.join(dirpath, f)
            if os.path.islink(path):
                continue
            executable = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)


@contextmanager
def write_atomically(out: Path, force: bool = False):
    """Yields a temporary directory beside `out`; on success it replaces `out` (with umask modes, see
    apply_umask_modes), on failure it is removed."""
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"output {out} already exists (use --force to overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        apply_umask_modes(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
