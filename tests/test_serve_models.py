"""Each model family on tiny random weights (saved as HF checkpoints) against HF transformers, greedy, batched."""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.serve import LLM, SamplingParams

torch.set_num_threads(1)
SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)


def configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        "llama3": LlamaConfig(**SMALL, rope_parameters=llama3_rope),
        "llama-bias": LlamaConfig(**SMALL | {"tie_word_embeddings": True}, attention_bias=True, mlp_bias=True),
        "qwen2": Qwen2Config(**SMALL),
        "qwen3": Qwen3Config(**SMALL, head_dim=32),
    }


@pytest.mark.parametrize("family", ["llama3", "llama-bias", "qwen2", "qwen3"])
def test_family_greedy_equals_hf(family, tmp_path):
    torch.manual_seed(0)
    config = configs()[family]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, tmp_path / f.name)
    prompts = [[(7 * i + 3) % 1000 + 5 for i in range(n)] for n in (3, 40, 70)]  # past the original 32 positions
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    llm = LLM(str(tmp_path), num_kv_blocks=32, max_num_tokens=48)  # also chunks the 70-token prompt
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
