"""Gemma 2 and Gemma 3 (text) on tiny random weights, saved as HF checkpoints, against HF transformers: greedy tokens
equal `generate`, prompt logprobs within fp32 tolerance, under batching, chunked prefill, prefix reuse and
preemption; sliding windows smaller than the prompts, soft-capping that bites, (1 + weight) norms away from 1."""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.serve import LLM, SamplingParams
from lowbit.serve.models import model_class

torch.set_num_threads(1)
SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             sliding_window=12, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             query_pre_attn_scalar=24)
PROMPTS = [[(7 * i + 3) % 1000 + 5 for i in range(n)] for n in (3, 40, 70)]  # longer than the window
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def gemma_config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig

    if family == "gemma2":  # tied embeddings (at 0.2 the tied model repeats its input token); caps that bite
        return Gemma2Config(**SMALL | {"initializer_range": 0.02}, attn_logit_softcapping=2.0,
                            final_logit_softcapping=8.0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}
    return Gemma3TextConfig(**SMALL, rope_parameters=rope, tie_word_embeddings=False)


def save_tiny(family: str, path):
    """A random model of the family saved with its tokenizer; norm weights drawn away from 0 (HF inits them to 0,
    where (1 + w) and w conventions would agree on nothing but the scale), q and k scaled up."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # scores of a few units, where the soft cap changes them
    model.save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return model


def hf_greedy(model, prompts, n=8):
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny(request.param, path)
    return path, model, hf_greedy(model, PROMPTS)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_and_chunked_greedy_equals_hf(tiny):
    path, _, expected = tiny
    llm = LLM(str(path), device="cpu", num_kv_blocks=32, max_num_tokens=48)  # chunks the 70-token prompt
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_tokens=7, enable_prefix_caching=False)  # chunks across windows
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_preemption_keeps_hf_tokens(tiny):
    path, model, _ = tiny
    prompts = [PROMPTS[2][i:i + 30] for i in range(3)]  # 2 blocks of 16 each, a third once decoding passes 32
    llm = LLM(str(path), device="cpu", num_kv_blocks=5, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == hf_greedy(model, prompts)


def test_prefix_reuse_keeps_hf_tokens(tiny):
    path, model, _ = tiny
    shared = PROMPTS[2][:48]
    prompts = [shared + [11, 12, 13], shared + [901, 902]]
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    assert tokens(llm.generate(prompts[:1], GREEDY)) == hf_greedy(model, prompts[:1])
    assert tokens(llm.generate(prompts, GREEDY)) == hf_greedy(model, prompts)
    assert llm.engine.block_manager.num_hit_tokens >= 32 * 2


def test_prompt_logprobs_match_hf(tiny):
    path, model, _ = tiny
    ids = PROMPTS[2]
    llm = LLM(str(path), device="cpu", num_kv_blocks=32)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert [e[0] for e in out.prompt_logprobs[1:]] == pytest.approx(
        [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("bad, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "activation 'relu'"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
])
def test_unimplemented_config_keys_fail_by_name(family, bad, message):
    config = gemma_config(family).to_dict() | {"architectures": [f"{family.capitalize()}ForCausalLM"]} | bad
    with pytest.raises(ValueError, match=message):
        model_class(config)(config)


def test_unknown_rope_type_fails_by_name():
    config = gemma_config("gemma3").to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    config["rope_parameters"]["full_attention"] = {"rope_type": "bogus_rope", "rope_theta": 1e6}
    with pytest.raises(ValueError, match="bogus_rope"):
        model_class(config)(config)


def test_gemma3_config_without_layer_types_uses_the_older_keys():
    """Configs written before transformers 5: sliding_window_pattern, rope_theta + rope_scaling for the global layers,
    rope_local_base_freq for the local ones."""
    from lowbit.serve.layers.rotary import rope_inv_freq
    from lowbit.serve.models.gemma import Gemma3ForCausalLM

    config = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7, "sliding_window_pattern": 6,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    from lowbit.serve.models.gemma import layer_types
    assert layer_types(config, 6) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    full = rope_inv_freq(Gemma3ForCausalLM.rope_config(config, "full_attention"), 16)
    local = rope_inv_freq(Gemma3ForCausalLM.rope_config(config, "sliding_attention"), 16)
    base = torch.arange(0, 16, 2).float() / 16
    assert torch.allclose(full, 1.0 / (1e6 ** base) / 8.0) and torch.allclose(local, 1.0 / (1e4 ** base))
