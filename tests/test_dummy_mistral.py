"""The Mistral-7B-shaped dummy preset: its checkpoint names and shapes are what the served model loads (CPU), and on a
GPU the engine check (kernels + CUDA graphs vs the reference path) passes for it in fp8 and int4_awq."""
import pytest
import torch

from lowbit.serve.layers.linear import Linear, MergedLinear
from lowbit.serve.models import MistralForCausalLM, model_class
from lowbit.testing.dummy_weights import MISTRAL_7B, _linear_shape, dummy_checkpoint


def load_bench():
    from lowbit.bench import serve_bench
    return serve_bench


@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_preset_names_and_shapes_fit_the_served_model(fmt):
    ckpt = dummy_checkpoint(fmt, MISTRAL_7B, device="cpu")
    with torch.device("meta"):
        model = model_class(ckpt.config)(ckpt.config)
    assert isinstance(model, MistralForCausalLM)
    names = ckpt.tensors().names
    lin = "model.layers.31.self_attn"
    assert {f"{lin}.{p}_proj.weight" for p in "qkvo"} <= names and "model.layers.32.mlp.up_proj.weight" not in names
    checked = 0
    for name, module in model.named_modules():
        if name.endswith(".merged") or not isinstance(module, (Linear, MergedLinear)):
            continue
        checked += 1
        if isinstance(module, MergedLinear):  # its HF parts are in the checkpoint with the rows it splits into
            hf = [f"{name.rsplit('.', 1)[0]}.{p}" for p in module.part_names]
            assert all(f"{h}.weight" in names for h in hf), name
            assert [_linear_shape(MISTRAL_7B, h) for h in hf] == [(n, module.merged.in_features)
                                                                  for n in module.out_sizes], name
        else:
            assert name == "lm_head" or f"{name}.weight" in names, name
            assert _linear_shape(MISTRAL_7B, name) == (module.out_features, module.in_features), name
    assert checked == 32 * 4 + 1  # qkv, o, gate_up, down per layer, and lm_head


def test_tiny_mistral_engine_runs_the_bench_greedy_path():
    bench = load_bench()
    args = bench.parse(["--tiny", "--device", "cpu", "--model", "mistral-7b", "--phases", "check,formats"])
    engine = bench.build_engine(args, "fp8", max_batch_size=4, max_num_tokens=40, num_kv_blocks=64)
    assert isinstance(engine.runner.model, MistralForCausalLM)
    prompts = [bench.random_prompts(1, n, 512, seed=n)[0] for n in (3, 21, 50)]
    tokens, logits, _ = bench.greedy_with_logits(engine, prompts, 4)
    alone = bench.greedy_with_logits(engine, prompts[1:2], 4)[0]
    assert tokens[1] == alone[0] and all(len(t) == 4 for t in tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
def test_mistral_kernels_and_graphs_match_reference_path_on_gpu(fmt):
    bench = load_bench()
    res = bench.check_format(bench.parse(["--check-layers", "2", "--model", "mistral-7b", "--phases", "check"]), fmt)
    assert res["graph_used"] and res["pass"], res
