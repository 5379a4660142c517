"""`lowbit bench spec --tiny` on the CPU: it prints command, machine and date, a verify-step time for every batch
size and k, and the batch-1 run's outputs with and without n-gram drafting are identical."""
import json

import pytest

from lowbit.bench_cli import load


def test_spec_bench_tiny_times_every_point_and_agrees(tmp_path, capsys):
    out = tmp_path / "spec.jsonl"
    argv = ["--tiny", "--device", "cpu", "--batch-sizes", "1,3", "--ks", "1,4", "--repeats", "1", "--context", "32",
            "--passage", "16", "--output-len", "24", "--json", str(out)]
    assert load("spec").main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("command: lowbit bench spec --tiny") and "\nmachine: cpu" in printed
    assert "\ndate: " in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    verify = [r for r in rows if r["bench"] == "spec-verify"]
    assert [r["batch"] for r in verify] == [1, 3]
    assert all(r[key] > 0 for r in verify for key in ("decode_ms", "verify_k1_ms", "verify_k4_ms"))
    (b1,) = [r for r in rows if r["bench"] == "spec-batch1"]
    assert b1["identical_output"] is True and b1["plain_tok_s"] > 0 and b1["ngram_tok_s"] > 0
    assert "outputs identical" in printed


@pytest.mark.slow
def test_spec_bench_draft_model_batch1_on_the_embedded_model(tmp_path, capsys):
    """`--model M --draft-model M --batch1-only`: the model drafting for itself accepts every draft, outputs agree."""
    out = tmp_path / "spec.jsonl"
    argv = ["--device", "cpu", "--model", "smollm2-135m", "--draft-model", "smollm2-135m", "--batch1-only",
            "--output-len", "12", "--json", str(out)]
    assert load("spec").main(argv) == 0
    rows = {r["bench"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"spec-batch1", "spec-batch1-draft"}
    draft = rows["spec-batch1-draft"]
    assert draft["identical_output"] is True and draft["draft_tok_s"] > 0 and draft["acceptance_rate"] == 1.0
    assert "drafted by smollm2-135m" in capsys.readouterr().out
