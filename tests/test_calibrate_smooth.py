"""The smoothing fold (calibrate/smooth.py) on tiny random models of every family lowbit quantizes: the float logits
are unchanged, alpha moves the spread where its definition says, expert blocks fold their shared input (router and
every expert) but not their down_proj, and bad recipe values fail with one line."""
from types import SimpleNamespace

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from lowbit.calibrate.smooth import folds, recording, smooth
from lowbit.errors import UserError
from lowbit.recipe import load_recipe, recipe_from_dict

torch.set_num_threads(1)
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.05)
# fp32 forward before and after the fold, which changes only the order of roundings: measured rel-L2 1e-7..6e-7
FLOAT_REL = 1e-5
CONFIGS = {
    "llama-biases": lambda: LlamaConfig(**BASE, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**BASE),
    "qwen2": lambda: Qwen2Config(**BASE),
    "qwen3": lambda: Qwen3Config(**BASE),
    "phi3": lambda: Phi3Config(**{k: v for k, v in BASE.items() if k != "head_dim"}, pad_token_id=0),
    "gemma2": lambda: Gemma2Config(**BASE, query_pre_attn_scalar=16),
    "gemma3": lambda: Gemma3TextConfig(**BASE, query_pre_attn_scalar=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(**BASE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                        mlp_only_layers=[1]),
    "mixtral": lambda: MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2),
}


def tiny(name: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from their init (ones / zeros) and channels of very different scale
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) * 2 - 0.5)
            if n.endswith("bias"):  # initialized to zero: a fold that forgot v's or up's bias would pass unseen
                p.normal_(0.0, 0.1)
            if n.endswith(("v_proj.weight", "up_proj.weight", "qkv_proj.weight", "gate_up_proj.weight")):
                p.mul_(torch.rand(p.shape[0], 1) * 4)
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 24), generator=g) for _ in range(2)]


def run(batch_list):
    def loop(model):
        with torch.no_grad():
            for b in batch_list:
                model(b)
    return loop


def layer_stats(model, stat: str):
    layers = list(model.model.layers)
    with recording(layers, model.config) as st:
        run(batches())(model)
    return {key: st.statistic(key, stat) for key in st.n}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fold_keeps_float_logits(name):
    model = tiny(name)
    probe = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(probe).logits
    before = {n: p.clone() for n, p in model.named_parameters()}
    smooth(model, run(batches()), alpha=0.5, stat="rms")
    with torch.no_grad():
        got = model(probe).logits
    assert ((got - ref).norm() / ref.norm()).item() < FLOAT_REL
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "model.layers.0.input_layernorm.weight" in changed  # the fold happened
    if name in ("qwen3_moe", "mixtral"):  # layer 0 is sparse: the router and every expert's gate/up took s
        assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= changed
        assert "model.layers.0.mlp.experts.down_proj" not in changed


@pytest.mark.parametrize("name", ["llama-biases", "phi3", "gemma3", "qwen3_moe"])
def test_alpha_one_evens_the_inputs_alpha_zero_the_weights(name):
    # alpha 1: s = rms(x) / geomean, so every smoothed input channel of a group has the same RMS (o excepted: its s is
    # shared by the query heads of a kv head); alpha 0: s = 1 / max|W col|, so the readers' column maxima are equal
    model = tiny(name)
    smooth(model, run(batches()), alpha=1.0, stat="rms")
    for (i, group), rms in layer_stats(model, "rms").items():
        if group != "o":
            assert (rms.max() / rms.min()).item() == pytest.approx(1.0, abs=1e-4), (i, group)
    model = tiny(name)
    smooth(model, run(batches()), alpha=0.0, stat="rms")
    for layer in model.model.layers:
        for f in folds(layer, model.config):
            if f.name != "o":
                w = torch.stack([r.abs().reshape(-1, r.shape[-1]).amax(0) for r in f.readers]).amax(0)
                assert (w.max() / w.min()).item() == pytest.approx(1.0, abs=1e-4), f.name


def test_expert_blocks_fold_their_input_not_their_down_proj():
    model = tiny("qwen3_moe")  # layer 0 sparse, layer 1 dense (mlp_only_layers)
    names = [[f.name for f in folds(layer, model.config)] for layer in model.model.layers]
    assert names == [["qkv", "o", "mlp"], ["qkv", "o", "mlp", "down"]]
    mixtral = tiny("mixtral")
    assert [f.name for f in folds(mixtral.model.layers[0], mixtral.config)] == ["qkv", "o", "mlp"]


def test_unknown_family_is_refused():
    model = tiny("llama-biases")
    with pytest.raises(UserError, match="model type 'gpt2' is not supported"):
        folds(model.model.layers[0], SimpleNamespace(model_type="gpt2"))


def test_shipped_nvfp4_recipe_smooths():
    r = load_recipe("nvfp4")
    assert (r.smoothing, r.smoothing_alpha) == ("rms", 0.5)


@pytest.mark.parametrize("override, message", [
    ({"smoothing": "mean"}, "bad value for 'smoothing': 'mean' is not one of rms, max or null"),
    ({"smoothing": "rms", "smoothing_alpha": 1.5}, "bad value for 'smoothing_alpha': 1.5 is not a number in [0, 1]"),
    ({"smoothing": "rms", "smoothing_alpha": True}, "bad value for 'smoothing_alpha': True is not a number"),
])
def test_bad_smoothing_values_fail_with_one_line(override, message):
    data = load_recipe("fp8").to_dict() | override
    with pytest.raises(UserError) as e:
        recipe_from_dict(data)
    assert message in str(e.value) and "\n" not in str(e.value)
