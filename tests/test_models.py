import threading
import time

import pytest

from lowbit import models
from lowbit.errors import UserError


def test_resolve_store_name_and_local_dir(embedded_model_dir):
    assert models.resolve(models.DEFAULT_MODEL) == embedded_model_dir
    assert models.resolve(str(embedded_model_dir)) == embedded_model_dir


def test_resolve_errors(tmp_path):
    with pytest.raises(UserError, match="unknown model"):
        models.resolve("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        models.resolve(str(tmp_path / "empty"))


def test_concurrent_conversions_run_once(tmp_path, monkeypatch):
    """Two converters at once: the file lock lets one convert; the other finds the finished directory."""
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path))
    calls = []

    def fake_convert(source, out):
        calls.append(out)
        time.sleep(0.5)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x" * 10)

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.convert_embedded_model())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results[0] == results[1] == tmp_path / "models" / models.DEFAULT_MODEL
    assert (results[0] / "config.json").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [models.DEFAULT_MODEL]  # no temporary left


def test_list_models_describes_entries(embedded_model_dir):
    entry = models.describe(embedded_model_dir)
    assert entry["name"] == models.DEFAULT_MODEL and entry["quantization"] == "none" and entry["size_mb"] > 100
