"""End to end: a checkpoint with corrupted scales fails the gate (exit 1), the real FP8 checkpoint passes it,
and the baseline is computed once."""
import json
import shutil
import sys

import pytest

from lowbit import cli

pytestmark = pytest.mark.slow
GATE = "recovery>=0.98,ppl_ratio<=1.03"
TASKS, LIMIT, PPL_SEQS = ["arc_easy", "ppl"], 8, 1
ARGS = ["--baseline", "smollm2-135m", "--tasks", ",".join(TASKS), "--limit", str(LIMIT), "--ppl-seqs", str(PPL_SEQS)]


def run_eval(argv) -> int:
    old = sys.argv
    sys.argv = ["lowbit", "eval", *argv]  # lowbit.cli picks the subcommand module from sys.argv
    try:
        return cli.main(["eval", *argv])
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def fp8_checkpoint(embedded_model_dir, tmp_path_factory):
    from lowbit.models import is_model_dir, store_path

    if is_model_dir(store_path("smollm2-135m-fp8")):
        return store_path("smollm2-135m-fp8")
    from lowbit.quantize.api import quantize

    return quantize("smollm2-135m", "fp8", out=tmp_path_factory.mktemp("q") / "fp8", num_samples=4, seq_len=128).out


@pytest.fixture(scope="module")
def corrupted_checkpoint(fp8_checkpoint, tmp_path_factory):
    """The FP8 checkpoint with every weight_scale multiplied by 3 or 1/3 in turn (a broken export)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("corrupt") / "fp8-bad-scales"
    shutil.copytree(fp8_checkpoint, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        names = sorted(k for k in tensors if k.endswith(".weight_scale"))
        for i, k in enumerate(names):
            tensors[k] = tensors[k] * (3.0 if i % 2 == 0 else 1 / 3)
        save_file(tensors, f, metadata={"format": "pt"})
    return out


@pytest.fixture(autouse=True, scope="module")
def warm_baseline(embedded_model_dir, tmp_path_factory):
    """A private eval cache holding the baseline, computed here once: both runs below must only read it."""
    from lowbit.evaluate import cache
    from lowbit.evaluate.runner import Plan, Side, baseline_results

    mp, where = pytest.MonkeyPatch(), tmp_path_factory.mktemp("eval-cache")
    mp.setattr(cache, "cache_dir", lambda: where)
    first = baseline_results(Side("smollm2-135m", embedded_model_dir), Plan(TASKS, LIMIT, PPL_SEQS))
    assert first["cached"] == []
    yield
    mp.undo()


def test_corrupted_scales_fail_the_gate(corrupted_checkpoint, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert run_eval([str(corrupted_checkpoint), *ARGS, "--gate", GATE, "--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "**gate FAILED**" in out and "| FAIL |" in out
    result = json.loads(report.read_text())
    assert not result["gate"]["passed"] and sorted(result["baseline_cached"]) == sorted(TASKS)
    verdicts = {row["metric"]: row["verdict"] for row in result["gate"]["rows"]}
    assert verdicts["ppl_ratio"] == "fail" and result["summary"]["ppl_ratio"][0] > 1.5


def test_fp8_passes_and_baseline_is_cached(fp8_checkpoint, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert run_eval([str(fp8_checkpoint), *ARGS, "--gate", GATE, "--report", str(report)]) == 0
    assert "**gate PASSED**" in capsys.readouterr().out
    result = json.loads(report.read_text())
    assert sorted(result["baseline_cached"]) == sorted(TASKS)
    kl, top1 = result["summary"]["kl"][0], result["summary"]["top1"][0]
    assert 0 < kl < 0.2 and 0.7 < top1 < 1
