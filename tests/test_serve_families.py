"""Mistral, Phi-3 (fused qkv/gate_up, LongRoPE) and Qwen3 on tiny random HF checkpoints against transformers:
greedy tokens and prompt logprobs, batched, with chunked prefill, prefix reuse and preemption."""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.serve import LLM, SamplingParams

torch.set_num_threads(1)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=False)
ORIGINAL = 32  # Phi-3's original context: decoding past it switches to the long factors
MAX_TOKENS = 10
WINDOW = 11  # Mistral's and Phi-3's sliding window: smaller than most prompts, and not a block multiple
LOGPROB_TOL = 1e-4  # fp32 end to end; measured differences are ~1e-6
# token-id prompts; the longest (28) ends below ORIGINAL and its generation crosses it
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(n)] for n in (28, 3, 17)]
SHARED = [(11 * i + 1) % 500 + 5 for i in range(20)]  # more than one 16-token block, for prefix reuse


def config(family: str):
    from transformers import MistralConfig, Phi3Config, Qwen3Config

    if family == "mistral":
        return MistralConfig(**SMALL, head_dim=32, max_position_embeddings=256, sliding_window=WINDOW)
    if family == "phi3":
        half = SMALL["hidden_size"] // SMALL["num_attention_heads"] // 2
        longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
                    "short_factor": [1.0 + 0.25 * i for i in range(half)],
                    "long_factor": [3.0 + 2.0 * i for i in range(half)]}
        return Phi3Config(**SMALL, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
                          rope_parameters=longrope, sliding_window=WINDOW, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return Qwen3Config(**SMALL, head_dim=32, max_position_embeddings=256)


@pytest.fixture(scope="module", params=["mistral", "phi3", "qwen3"])
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(request.param), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return request.param, model, str(path)


def hf_greedy(model, prompts, max_tokens=MAX_TOKENS):
    """transformers' greedy tokens; Phi-3 decoded step by step with its cache (see hf_greedy_cached)."""
    if model.config.model_type == "phi3":
        return [hf_greedy_cached(model, ids, max_tokens) for ids in prompts]
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


@torch.no_grad()
def hf_greedy_cached(model, ids, max_tokens):
    """Greedy decoding through transformers' model and KV cache, one token per forward: its rotary gives position p
    the long factors once p >= ORIGINAL, as the engine's cache does. (transformers' generate instead re-runs the whole
    sequence with the long factors once it outgrows ORIGINAL; the two agree while it does not.)"""
    from transformers import DynamicCache

    cache, tokens = DynamicCache(config=model.config), list(ids)
    logits = model(torch.tensor([tokens]), cache=cache, use_cache=True).logits
    for _ in range(max_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens[-1:]]), cache=cache, use_cache=True,
                       position_ids=torch.tensor([[len(tokens) - 1]])).logits
    return tokens[len(ids):]


def served(path, prompts, max_tokens=MAX_TOKENS, **engine):
    llm = LLM(path, device="cpu", **{"num_kv_blocks": 32} | engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
def test_phi3_within_original_context_equals_generate(family):
    _, model, path = family
    prompts = [p for p in PROMPTS if len(p) + MAX_TOKENS <= ORIGINAL]
    assert len(prompts) == 2
    hf = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        hf.append(gen[0, len(ids):].tolist())
    assert served(path, prompts)[1] == hf


def test_greedy_batched_equals_hf(family):
    _, model, path = family
    llm, got = served(path, PROMPTS)
    assert got == hf_greedy(model, PROMPTS)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_keeps_outputs(family):
    _, model, path = family
    _, got = served(path, PROMPTS, max_num_tokens=7, enable_prefix_caching=False)
    assert got == hf_greedy(model, PROMPTS)


def test_preemption_keeps_outputs(family):
    _, model, path = family
    # 40 slots for 78 tokens (the longest sequence, 38, fits); small blocks, so even a windowed model (which gives
    # back the blocks before its window) runs out
    llm, got = served(path, PROMPTS, num_kv_blocks=10, block_size=4, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_greedy(model, PROMPTS)


def test_prefix_reuse_keeps_outputs(family):
    _, model, path = family
    prompts = [SHARED + [40, 41, 42], SHARED + [90]]
    llm = LLM(path, device="cpu", num_kv_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    both = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    expected = hf_greedy(model, prompts, 6)
    assert first == expected[:1] and both == expected
    assert llm.engine.block_manager.num_hit_tokens >= 16 * 2


def test_prompt_logprobs_equal_hf(family):
    _, model, path = family
    ids = PROMPTS[0]
    llm = LLM(path, device="cpu", num_kv_blocks=32)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    got = torch.tensor([chosen for chosen, _ in out.prompt_logprobs[1:]])
    want = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=LOGPROB_TOL, rtol=0)
