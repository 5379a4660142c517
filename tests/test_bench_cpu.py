"""`lowbit bench cpu` in a tiny configuration on the embedded model: both sides measured and printed side by side,
and the two sides agreeing (the same greedy tokens, prompt logprobs within 1e-4, as tests/test_serve_engine.py)."""
import json

import pytest

from lowbit.bench import cpu
from lowbit.bench_cli import BENCHES, load


def test_bench_cpu_prints_lowbit_and_transformers_side_by_side(embedded_model_dir, tmp_path, capsys):
    out = tmp_path / "cpu.jsonl"
    argv = [str(embedded_model_dir), "--new-tokens", "4", "--docs", "2", "--doc-tokens", "24", "--repeats", "1",
            "--json", str(out)]
    assert load("cpu").main(argv) == 0
    printed = capsys.readouterr().out
    decode, score = [json.loads(line) for line in out.read_text().splitlines()]
    assert decode["bench"] == "decode" and score["bench"] == "score"
    for r in (decode, score):
        assert r["lowbit_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["threads"] == 1
    assert decode["same_greedy_tokens"] == "4/4"
    assert score["scored_tokens"] == 2 * 23 and score["max_abs_logprob_diff"] < 1e-4
    assert "| model | benchmark | lowbit CPU engine | transformers | lowbit / HF | agreement |" in printed
    rows = [line for line in printed.splitlines() if line.startswith(f"| {embedded_model_dir} |")]
    assert len(rows) == 2 and "decode tok/s" in rows[0] and "score tok/s (2 docs, 46 tokens)" in rows[1]
    assert f"{decode['lowbit_tok_s']:.1f} | {decode['hf_tok_s']:.1f} |" in rows[0]


@pytest.mark.parametrize("flag", ["--threads", "--new-tokens", "--docs", "--doc-tokens", "--repeats"])
def test_bench_cpu_refuses_non_positive_counts_with_exit_2(flag, capsys):
    with pytest.raises(SystemExit) as e:
        cpu.main([flag, "0"])
    assert e.value.code == 2 and f"{flag} must be a positive integer" in capsys.readouterr().err
    assert BENCHES["cpu"] == "cpu"
