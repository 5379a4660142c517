"""Qwen3-MoE and Mixtral on tiny random HF checkpoints against transformers: greedy tokens batched, with chunked
prefill and with preemption; the router against transformers' (both norm_topk_prob settings)."""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.serve import LLM, SamplingParams
from lowbit.kernels.moe.route import moe_route_ref

torch.set_num_threads(1)
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2, tie_word_embeddings=False, max_position_embeddings=256, num_experts_per_tok=2)
MAX_TOKENS = 10
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(n)] for n in (28, 3, 17)]


def config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family == "mixtral":  # a window smaller than the longest prompt
        return MixtralConfig(**SMALL, intermediate_size=32, num_local_experts=4, sliding_window=11)
    # layer 0 sparse, layer 1 dense (mlp_only_layers); top-2 weights not renormalised
    return Qwen3MoeConfig(**SMALL, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                          norm_topk_prob=False, mlp_only_layers=[1])


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(request.param), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return request.param, model, str(path)


def hf_greedy(model, prompts):
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def served(path, prompts, **engine):
    llm = LLM(path, **{"num_kv_blocks": 32} | engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def test_model_layout(family):
    """The served model has the HF layout: sparse blocks where transformers has them, experts stacked."""
    name, model, path = family
    llm = LLM(path, num_kv_blocks=32)
    served_layers = llm.engine.runner.model.model.layers
    for hf_layer, layer in zip(model.model.layers, served_layers):
        block = getattr(layer, layer.mlp_name)
        assert hasattr(block, "experts") == hasattr(hf_layer.mlp, "experts")
        if hasattr(block, "experts"):
            assert torch.equal(block.experts.w13, hf_layer.mlp.experts.gate_up_proj)
            assert torch.equal(block.experts.w2, hf_layer.mlp.experts.down_proj)


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
    llm, got = served(path, PROMPTS, num_kv_blocks=10, block_size=4, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_greedy(model, PROMPTS)


@pytest.mark.parametrize("norm", [False, True])
def test_route_equals_hf_router(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 16)
    _, hf_weights, hf_ids = router(x)
    weights, ids = moe_route_ref(torch.nn.functional.linear(x, router.weight), 3, norm)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, atol=1e-6, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(5)) == norm


def test_bench_counts_expert_weights(family):
    """`lowbit bench serve`'s weight size counts the stacked experts: the float model's bytes exactly."""
    from lowbit.bench.serve_bench import weight_bytes

    name, model, path = family
    llm = LLM(path, num_kv_blocks=32)
    hf_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(llm.engine) == hf_bytes
