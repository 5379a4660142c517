"""Speculative decoding with a draft model on tiny random models: greedy and seeded outputs equal decoding without it
(draft = the target itself: every draft accepted; a perturbed copy: some; another random model: few) through
batching, chunked prefill, preemption, prefix reuse, overlapped steps, stop rules, max_tokens and aborts; both KV
pools come back to empty; the pool budget is split between them; bad draft models fail with one line."""
import json
from types import SimpleNamespace

import pytest
import torch

from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.runner import kv_cache
from lowbit.serve.spec.draft_model import check_same_vocabulary
from lowbit.testing.dummy_weights import dummy_checkpoint
from test_serve_host_path import TINY, CharTokenizer, tiny_engine
from test_serve_spec import GREEDY, PROMPTS, assert_same, generate

torch.set_num_threads(1)
SMALL = dict(TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16)  # same vocabulary
DRAFTS = {"self": dict(config=TINY), "perturbed": dict(config=TINY, std=0.1), "other": dict(config=SMALL, seed=1)}


def draft_engine(draft: str = "self", **config) -> Engine:
    """tiny_engine's target (bf16, seed 0) drafted for by DRAFTS[draft]."""
    ckpt = dummy_checkpoint("bf16", TINY, device="cpu")
    d = DRAFTS[draft]
    draft_ckpt = dummy_checkpoint("bf16", d["config"], seed=d.get("seed", 0), device="cpu",
                                  std=d.get("std", 0.02))
    cfg = dict(max_batch_size=4, max_num_tokens=24, num_kv_blocks=24, block_size=4, device="cpu", dtype="float32",
               speculative="draft", speculative_adaptive=False, draft_model=f"tiny-{draft}")
    return Engine(ckpt.path, EngineConfig(**cfg | config), ckpt=ckpt, tokenizer=CharTokenizer(),
                  draft_ckpt=draft_ckpt)


def assert_acceptance(engine, draft: str) -> None:
    s = engine.spec
    assert s.num_steps > 0 and s.num_drafted > 0
    if draft == "self":  # the target drafting for itself: every draft is its own greedy token
        assert s.num_accepted == s.num_drafted
    elif draft == "perturbed":  # some accepted, some rolled back
        assert 0 < s.num_accepted < s.num_drafted
    else:
        assert s.num_accepted < 0.5 * s.num_drafted


def assert_pools_empty(engine) -> None:
    assert engine.block_manager.num_used_blocks == 0
    assert engine.spec.drafter.block_manager.num_used_blocks == 0 and not engine.spec.drafter.shadows


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("settings", [
    dict(num_kv_blocks=96),  # plain continuous batching
    dict(num_kv_blocks=96, max_num_tokens=7),  # chunked prefill, the verify budget, the draft catch-up in chunks
    dict(num_kv_blocks=30, enable_prefix_caching=False),  # preemption (4 x ~80 tokens in 120 slots)
    dict(num_kv_blocks=96, overlap_steps=True),  # overlapped steps around the verify steps
], ids=["batch", "chunked", "preempt", "overlap"])
def test_greedy_outputs_equal_plain_decoding(settings, draft):
    plain = generate(tiny_engine(**settings), PROMPTS, GREEDY)
    engine = draft_engine(draft, **settings)
    assert_same(plain, generate(engine, PROMPTS, GREEDY))
    assert_acceptance(engine, draft)
    assert_pools_empty(engine)
    if settings["num_kv_blocks"] == 30:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_reuse_on_the_target_the_draft_recomputes():
    """A second round finds the first round's blocks on the target side; the draft side recomputes those prefixes
    and still drafts the target's own tokens."""
    engine = draft_engine("self", num_kv_blocks=96)
    first = generate(engine, PROMPTS, GREEDY)
    extended = [p + ids[:20] for p, (ids, *_) in zip(PROMPTS, first)]
    hits = engine.block_manager.num_hit_tokens
    again = generate(engine, extended, GREEDY)
    assert engine.block_manager.num_hit_tokens - hits >= 4 * 16
    assert_same(generate(tiny_engine(num_kv_blocks=96), extended, GREEDY), again)
    assert engine.spec.num_accepted == engine.spec.num_drafted
    assert_pools_empty(engine)


@pytest.mark.parametrize("draft", ["self", "perturbed"])
def test_seeded_sampling_stop_rules_logprobs_and_max_tokens_equal_plain_decoding(draft):
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=1, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=5, top_p=0.9, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=0),  # max_tokens mid-draft
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=["dn"], stop_token_ids=[202])]
    plain = generate(tiny_engine(num_kv_blocks=96), PROMPTS, params)
    engine = draft_engine(draft, num_draft_tokens=3, num_kv_blocks=96)
    spec = generate(engine, PROMPTS, params, stream=True)
    assert_same(plain, spec)
    assert len(spec[2][0]) == 9 and spec[2][2] == "length"
    assert engine.spec.num_accepted > 0
    assert_pools_empty(engine)


def test_abort_frees_the_draft_pool_too():
    engine = draft_engine("self", num_kv_blocks=96)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.spec.num_steps > 0 and engine.spec.drafter.block_manager.num_used_blocks > 0
    for i in range(len(PROMPTS)):
        engine.abort(f"r{i}")
    assert_pools_empty(engine)
    gauges = engine.gauges()
    assert gauges["lowbit_spec_draft_kv_blocks_used"][0] == 0 and gauges["lowbit_spec_draft_kv_blocks_total"][0] == 96


def test_the_pool_budget_is_split_between_target_and_draft(monkeypatch):
    """CPU sizing: kv_cache_fraction of the RAM / (target + draft bytes per block) blocks for each side."""
    monkeypatch.setattr(kv_cache, "_available_ram", lambda: 10_000_000)
    engine = draft_engine("other", num_kv_blocks=None, kv_cache_fraction=0.1)
    target, draft = engine.runner, engine.spec.drafter.runner
    per_block = [kv_cache.bytes_per_block(r.attn_layers, 4, torch.float32) for r in (target, draft)]
    assert per_block == [1 * 2 * 32 * 4 * 4, 2 * 2 * 16 * 4 * 4]  # layers x K,V x head_dim x block_size x bytes
    assert target.num_blocks == draft.num_blocks == 1_000_000 // sum(per_block)
    assert tuple(draft.attn_layers[0].kv_cache.shape) == (2, draft.num_blocks, 4, 1, 16)
    alone = tiny_engine(num_kv_blocks=None, kv_cache_fraction=0.1)
    assert alone.runner.num_blocks == 1_000_000 // per_block[0]


def test_a_draft_model_with_another_vocabulary_fails_at_load_with_one_line():
    ckpt = dummy_checkpoint("bf16", TINY, device="cpu")
    other = dummy_checkpoint("bf16", dict(TINY, vocab_size=640), device="cpu")
    config = EngineConfig(num_kv_blocks=24, block_size=4, device="cpu", speculative="draft", draft_model="big-vocab")
    with pytest.raises(ValueError, match="draft_model big-vocab: vocabulary of 640 tokens, the target's has 512; "
                                         "a draft model needs the target's tokenizer") as e:
        Engine(ckpt.path, config, ckpt=ckpt, tokenizer=CharTokenizer(), draft_ckpt=other)
    assert "\n" not in str(e.value)


def test_a_draft_model_with_another_tokenizer_fails_with_one_line(tmp_path):
    def model_dir(name, vocab):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
        return SimpleNamespace(path=tmp_path / name, config={"vocab_size": 3})

    target = model_dir("t", {"a": 0, "b": 1, "c": 2})
    check_same_vocabulary(target, model_dir("same", {"a": 0, "b": 1, "c": 2}), "same")
    with pytest.raises(ValueError, match="draft_model swapped: its tokenizer maps tokens to other ids") as e:
        check_same_vocabulary(target, model_dir("swapped", {"a": 1, "b": 0, "c": 2}), "swapped")
    assert "\n" not in str(e.value)


def test_draft_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="speculative: draft is not supported with tensor_parallel_size > 1"):
        EngineConfig(speculative="draft", draft_model="d", tensor_parallel_size=2)


@pytest.mark.parametrize("settings", [dict(num_kv_blocks=96, max_num_tokens=7),
                                      dict(num_kv_blocks=30, enable_prefix_caching=False)], ids=["chunked", "preempt"])
def test_drafts_are_the_draft_models_own_greedy_continuation(settings):
    """Every proposal equals what the draft model alone generates greedily from the target's tokens: the shadow
    K/V, caught up, rolled back and recomputed, is the draft model's K/V of exactly those tokens."""
    engine = draft_engine("perturbed", **settings)
    drafter, calls = engine.spec.drafter, []
    propose = drafter.propose

    def recorded(seqs, limits):
        drafts = propose(seqs, limits)
        calls.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts) if d)
        return drafts

    drafter.propose = recorded
    generate(engine, PROMPTS, GREEDY)
    assert len(calls) > 20
    d = DRAFTS["perturbed"]
    alone = Engine("draft", EngineConfig(max_batch_size=4, num_kv_blocks=256, block_size=4, device="cpu",
                                         dtype="float32"),
                   ckpt=dummy_checkpoint("bf16", d["config"], device="cpu", std=d["std"]), tokenizer=CharTokenizer())
    picked = calls[::max(1, len(calls) // 24)]  # ~24 proposals spread over the run
    expected = generate(alone, [t for t, _ in picked],
                        [SamplingParams(max_tokens=len(d), temperature=0, ignore_eos=True) for _, d in picked])
    assert [d for _, d in picked] == [ids for ids, *_ in expected]


def test_serve_with_a_draft_model_of_another_vocabulary_is_one_error_line(tmp_path):
    """`lowbit serve NAME --speculative draft --draft-model DIR`: the vocabularies are compared before any weight is
    loaded; exit 2 and one line."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port: the server binds before it loads the model
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 100}))
    bad = subprocess.run([sys.executable, "-m", "lowbit.cli", "serve", "smollm2-135m", "--port", str(port),
                          "--speculative", "draft", "--draft-model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if not line.startswith("[lowbit]")]
    assert errors == [f"error: draft_model {tmp_path}: vocabulary of 100 tokens, the target's has 49152; a draft "
                      f"model needs the target's tokenizer"]
