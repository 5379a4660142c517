"""`lowbit bench spec --tiny` on the CPU: it prints command, machine and date, a verify-step time for every batch
size and k, the break-even acceptance per batch size, and tokens/s per batch size with outputs identical with and
without n-gram drafting."""
import json

import pytest

from lowbit.bench_cli import load


def test_spec_bench_tiny_times_every_point_and_agrees(tmp_path, capsys):
    out = tmp_path / "spec.jsonl"
    argv = ["--tiny", "--device", "cpu", "--batch-sizes", "1,3", "--ks", "1,4", "--repeats", "1", "--context", "32",
            "--passage", "16", "--output-len", "24", "--tps-batch-sizes", "1,2", "--json", str(out)]
    assert load("spec").main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("command: lowbit bench spec --tiny") and "\nmachine: cpu" in printed
    assert "\ndate: " in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    verify = [r for r in rows if r["bench"] == "spec-verify"]
    assert [r["batch"] for r in verify] == [1, 3]
    assert all(r[key] > 0 for r in verify for key in ("decode_ms", "verify_k1_ms", "verify_k4_ms"))
    even = [r for r in rows if r["bench"] == "spec-break-even"]
    assert [r["batch"] for r in even] == [1, 3] and all(0 <= r["break_even_acceptance"] <= 1 for r in even)
    tps = [r for r in rows if r["bench"] == "spec-tps"]
    assert [r["batch"] for r in tps] == [1, 2]
    assert all(r["identical_outputs"] == r["requests"] and r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 for r in tps)
    assert all(r["divergences"] == [] for r in tps)
    assert [r["plain_same_as_previous_batch"] for r in tps][0] == "-"
    assert "auto-off: n-gram " in printed


def test_divergences_name_the_first_differing_token_and_the_gap_there():
    """A run that leaves plain's greedy tokens at position 5 of request 1 (and one that agrees) is reported as
    (1, 5, gap): gap is the top-2 logprob gap of a prefill of prompt + plain's first 5 tokens, whose best token is
    plain's own 6th token (fp32 on the CPU)."""
    spec = load("spec")
    args = spec.parse(["--tiny", "--device", "cpu", "--passage", "16", "--output-len", "12",
                       "--tps-batch-sizes", "2"])
    engine = spec.build(args)
    prompts = spec.synthetic_prompts(engine, args)
    _, plain, _ = spec.run_batch(engine, prompts, 12, None)
    other = [list(t) for t in plain]
    other[1][5] = (other[1][5] + 1) % engine.runner.model.config["vocab_size"]
    assert spec.divergences(engine, prompts, plain, [plain, plain]) == []
    [(request, position, gap)] = spec.divergences(engine, prompts, plain, [plain, other])
    assert (request, position) == (1, 5) and 0 < gap < 50
    params = spec.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("check", prompts[1] + plain[1][:5], params, stream=False)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == [plain[1][5]]


def test_break_even_acceptance_solves_tokens_per_step_equal_to_the_cost_ratio():
    spec = load("spec")
    assert spec.tokens_per_step(0.5, 3) == 1 + 0.5 + 0.25 + 0.125 and spec.tokens_per_step(1.0, 4) == 5
    a = spec.break_even(2.0, 4)
    assert abs(spec.tokens_per_step(a, 4) - 2.0) < 1e-6 and 0.5 < a < 0.55  # 1 + a + ... + a^4 = 2
    assert spec.break_even(0.9, 2) == 0.0 and spec.break_even(3.5, 2) == 1.0  # always pays / never pays


@pytest.mark.slow
def test_spec_bench_draft_model_batch1_on_the_embedded_model(tmp_path, capsys):
    """`--model M --draft-model M --batch1-only --tps-batch-sizes 1`: both workloads (quote, chat) with each drafter;
    the model drafting for itself accepts every draft, outputs agree."""
    out = tmp_path / "spec.jsonl"
    argv = ["--device", "cpu", "--model", "smollm2-135m", "--draft-model", "smollm2-135m", "--batch1-only",
            "--output-len", "12", "--tps-batch-sizes", "1", "--json", str(out)]
    assert load("spec").main(argv) == 0
    rows = [r for r in map(json.loads, out.read_text().splitlines()) if r["bench"] == "spec-tps"]
    assert [(r["drafter"], r["workload"]) for r in rows] == [("n-gram", "quote"), ("n-gram", "chat"),
                                                             ("drafted by smollm2-135m", "quote"),
                                                             ("drafted by smollm2-135m", "chat")]
    for draft in rows[2:]:
        assert draft["identical_outputs"] == 1 and draft["spec_tok_s"] > 0 and draft["acceptance_rate"] == 1.0
    assert "drafted by smollm2-135m" in capsys.readouterr().out


def test_spec_bench_host_only_quote_drafts_are_accepted_and_outputs_agree(tmp_path, capsys):
    """`--host-only`: scripted stub forward; on the quoting script every draft is accepted (k + 1 tokens per verify
    step), on the chat script drafts run out or miss; outputs equal plain decoding's in both."""
    out = tmp_path / "spec.jsonl"
    argv = ["--host-only", "--tps-batch-sizes", "1,2", "--repeats", "1", "--passage", "32", "--output-len", "48",
            "--num-draft-tokens", "4", "--json", str(out)]
    assert load("spec").main(argv) == 0
    rows = {(r["workload"], r["batch"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == [("chat", 1), ("chat", 2), ("quote", 1), ("quote", 2)]
    assert all(r["identical_outputs"] and r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 for r in rows.values())
    # k + 1 = 5 tokens per verify step, fewer in the steps that max_tokens cuts short
    assert rows["quote", 1]["acceptance_rate"] == 1.0 and 4.5 < rows["quote", 1]["tokens_per_step"] <= 5.0
    assert rows["chat", 1]["acceptance_rate"] < 1.0
    assert rows["chat", 1]["tokens_per_step"] < rows["quote", 1]["tokens_per_step"]
    assert "| quote | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--speculative-max-batch-size", "--num-draft-tokens"])
def test_non_positive_sizes_fail_with_one_line(flag, capsys):
    with pytest.raises(SystemExit) as e:
        load("spec").parse(["--host-only", flag, "0"])
    assert e.value.code == 2 and f"{flag} must be positive" in capsys.readouterr().err
