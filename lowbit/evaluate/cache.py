"""Baseline results on disk, under $LOWBIT_HOME/eval-cache, keyed by model content and evaluation settings.

Key = sha256 of (content hash of the model's weights, config and tokenizer files, task, limit, settings, versions).
A changed file, task definition, limit or lowbit/lm-eval version is a different key; nothing is ever invalidated.
"""
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from lowbit.models import home

FORMAT_VERSION = 2  # bump when what is stored (or how it is computed) changes
_HASHED_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".bin")


def cache_dir() -> Path:
    return home() / "eval-cache"


def model_hash(path: Path) -> str:
    """sha256 over the names and contents of the files that define the model's outputs."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file() and p.name.endswith(_HASHED_SUFFIXES)):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def key(model_digest: str, task: str, settings: dict) -> str:
    import lm_eval

    payload = {"model": model_digest, "task": task, "settings": settings, "format": FORMAT_VERSION,
               "lm_eval": getattr(lm_eval, "__version__", "?")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_json(k: str) -> dict | None:
    path = cache_dir() / f"{k}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def save_json(k: str, value: dict) -> None:
    _atomic_write(cache_dir() / f"{k}.json", lambda tmp: Path(tmp).write_text(json.dumps(value)))


def load_tensors(k: str) -> dict | None:
    path = cache_dir() / f"{k}.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def save_tensors(k: str, value: dict) -> None:
    _atomic_write(cache_dir() / f"{k}.pt", lambda tmp: torch.save(value, tmp))
