"""The speculative-decoding surface: `lowbit serve` flags and `--config` keys reach EngineConfig; a bad setting is
one error line and exit 2."""
import argparse
import subprocess
import sys

from lowbit.serve.server import cli


def parser():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p


def test_flags_and_config_keys_reach_the_engine_config(tmp_path):
    config = cli.engine_config(parser().parse_args(["m", "--speculative", "ngram", "--num-draft-tokens", "6"]))
    assert (config.speculative, config.num_draft_tokens, config.draft_model) == ("ngram", 6, None)
    config = cli.engine_config(parser().parse_args(["m", "--speculative", "draft", "--draft-model", "d"]))
    assert (config.speculative, config.draft_model, config.num_draft_tokens) == ("draft", "d", 4)
    extra = tmp_path / "extra.yaml"
    extra.write_text("speculative: ngram\nngram_size: 2\nspeculative_max_batch_size: 8\n")
    config = cli.engine_config(parser().parse_args(["m", "--config", str(extra)]))
    assert (config.speculative, config.ngram_size, config.speculative_max_batch_size) == ("ngram", 2, 8)
    assert cli.engine_config(parser().parse_args(["m"])).speculative is None


def test_bad_settings_are_one_error_line():
    for argv, line in [(["--speculative", "ngram", "--num-draft-tokens", "0"],
                        "error: num_draft_tokens must be an integer >= 1, got 0"),
                       (["--speculative", "draft"], "error: speculative: draft needs draft_model (a store name or "
                                                    "checkpoint directory)")]:
        bad = subprocess.run([sys.executable, "-m", "lowbit.cli", "serve", "m", *argv], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2
        assert bad.stderr.strip().splitlines() == [line]


def test_llm_with_ngram_speculation_quotes_real_text_identically():
    """`LLM(NAME, speculative="ngram")` on the embedded model: a prompt asking to repeat a passage gets the same
    greedy tokens as without speculation, and most drafts are accepted."""
    from lowbit.models import DEFAULT_MODEL
    from lowbit.serve import LLM, SamplingParams

    passage = "The committee agreed to fund the new library wing and to delay the road repairs until spring."
    prompt = f"Passage: {passage}\nRepeat it word for word.\nPassage: {passage}\nAgain:\nPassage:"
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(DEFAULT_MODEL, num_kv_blocks=64).generate(prompt, params)[0].outputs[0]
    llm = LLM(DEFAULT_MODEL, num_kv_blocks=64, speculative="ngram", speculative_adaptive=False, num_draft_tokens=4)
    spec = llm.generate(prompt, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    s = llm.engine.spec
    assert s.num_accepted / s.num_drafted > 0.5
    assert llm.engine.block_manager.num_used_blocks == 0
