"""CLI bad input: one line on stderr, exit code 2, nothing half-written."""
import subprocess
import sys

import pytest

from lowbit import models
from lowbit.cli import main, quantize_main


def run_main(capsys, argv, entry=main):
    code = entry(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_unknown_recipe(capsys, tmp_path):
    code, err = run_main(capsys, ["quantize", "--recipe", "fp7", "-o", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1 and "unknown recipe 'fp7'" in err[0]
    assert not (tmp_path / "out").exists()


def test_malformed_yaml(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nquant_algo: [FP8\n")
    code, err = run_main(capsys, ["--recipe", str(bad), "-o", str(tmp_path / "out")], entry=quantize_main)
    assert code == 2 and len(err) == 1 and "malformed YAML" in err[0]


def test_missing_model_path(capsys, tmp_path):
    code, err = run_main(capsys, ["quantize", "--recipe", "fp8", str(tmp_path / "nope"), "-o", str(tmp_path / "o")])
    assert code == 2 and len(err) == 1 and "unknown model" in err[0]
    assert not (tmp_path / "o").exists()


def test_existing_output_without_force(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_main(capsys, ["quantize", "--recipe", "fp8", "-o", str(out)])
    assert code == 2 and len(err) == 1 and "already exists" in err[0] and "--force" in err[0]
    assert (out / "keep.txt").read_text() == "mine"


def test_empty_calibration_file(capsys, tmp_path, embedded_model_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, err = run_main(capsys, ["quantize", "--recipe", "fp8", "--calib", str(empty), "-o", str(tmp_path / "o")])
    assert code == 2 and len(err) == 1 and "holds no text" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]  # no partial or temporary directory


def test_failed_export_leaves_nothing(tmp_path):
    from lowbit.checkpoint import write_atomically

    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with write_atomically(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("export failed half way")
    assert list(tmp_path.iterdir()) == []


def test_models_lists_store(capsys, embedded_model_dir):
    assert main(["models"]) == 0
    assert models.DEFAULT_MODEL in capsys.readouterr().out


def test_console_help_shows_examples():
    out = subprocess.run([sys.executable, "-m", "lowbit.cli", "quantize", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "examples:" in out.stdout and "--recipe fp8" in out.stdout
