"""Checkpoints and store entries get the modes a plain mkdir / open gives under the user's umask (not
tempfile's 0700 / safetensors' 0600), so other users and containers of another uid can read the store."""
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from lowbit import models
from lowbit.checkpoint.io import write_atomically


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def modes(root) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.stat().st_mode)
    return out


def write_checkpoint_files(directory) -> None:
    save_file({"w": torch.zeros(2)}, directory / "model.safetensors")  # safetensors itself writes 0600
    (directory / "config.json").write_text("{}")
    (directory / "sub").mkdir(mode=0o700)
    (directory / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (directory / "sub" / "run.sh").chmod(0o700)


@pytest.mark.parametrize("mask, dirs, files, executables", [(0o022, 0o755, 0o644, 0o755),
                                                            (0o027, 0o750, 0o640, 0o750)])
def test_write_atomically_follows_the_umask(tmp_path, umask, mask, dirs, files, executables):
    umask(mask)
    out = tmp_path / "ckpt"
    with write_atomically(out) as tmp:
        assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o700  # mkdtemp's own: nobody sees a half-written one
        write_checkpoint_files(tmp)
    assert modes(out) == {".": dirs, "config.json": files, "model.safetensors": files, "sub": dirs,
                          "sub/run.sh": executables}
    with write_atomically(out, force=True) as tmp:  # replacing an existing checkpoint: the same
        write_checkpoint_files(tmp)
    assert modes(out)["."] == dirs and modes(out)["model.safetensors"] == files


def test_embedded_model_conversion_follows_the_umask(tmp_path, umask, monkeypatch):
    """The store conversion with its GGUF step replaced by a writer of the same kinds of files."""
    umask(0o022)
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "gguf_source", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models, "_convert_gguf", lambda source, out: write_checkpoint_files(out))
    target = models.convert_embedded_model()
    assert target == models.store_path(models.DEFAULT_MODEL)
    assert modes(target) == {".": 0o755, "config.json": 0o644, "model.safetensors": 0o644, "sub": 0o755,
                             "sub/run.sh": 0o755}
