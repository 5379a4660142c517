"""Checkpoints the serve models do not implement fail at load with one ValueError naming the key and what is
supported (the CLI prints it as one error line), instead of serving wrong numbers."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lowbit.serve.engine.engine import Engine
from lowbit.serve.models import model_class

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6)


def build(config: dict):
    return model_class(config)(config)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(path)
    return path


def test_unsupported_architecture_names_the_supported_ones(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps(config | {"architectures": ["FalconForCausalLM"]}))
    try:
        with pytest.raises(ValueError, match=r"\['FalconForCausalLM'\] is not supported; supported: .*"
                                             r"'MistralForCausalLM', .*'Phi3ForCausalLM'"):
            Engine(str(llama_dir))
    finally:
        (llama_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "yarn", "factor": 4.0}, r"rope_type 'yarn' is not supported; supported: \['default', 'linear', "
                                           r"'llama3', 'longrope'\]"),
    ({"type": "dynamic", "factor": 2.0}, r"rope_type 'dynamic' is not supported"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5 is not supported"),
])
def test_unknown_rope_settings_fail(rope, message):
    config = TINY | {"architectures": ["LlamaForCausalLM"], "rope_scaling": rope}
    with pytest.raises(ValueError, match=message):
        build(config)


def test_mistral_activation_fails():
    with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported; supported: \['silu'\]"):
        build(TINY | {"architectures": ["MistralForCausalLM"], "hidden_act": "gelu"})


def test_phi3_partial_rotary_and_activation_fail():
    phi3 = TINY | {"architectures": ["Phi3ForCausalLM"], "hidden_act": "silu"}
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.75 is not supported"):
        build(phi3 | {"partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported"):
        build(phi3 | {"hidden_act": "gelu"})
    build(phi3 | {"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 16}})  # "su" is longrope


def test_qwen_sliding_window_layers_fail():
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        with pytest.raises(ValueError, match="use_sliding_window is not supported"):
            build(TINY | {"architectures": [arch], "use_sliding_window": True, "sliding_window": 8})
        build(TINY | {"architectures": [arch], "use_sliding_window": False, "sliding_window": 8})
