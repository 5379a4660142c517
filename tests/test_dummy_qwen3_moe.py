"""The Qwen3-30B-A3B-shaped dummy preset: its checkpoint lists exactly what the served model loads, at the preset's
shapes (CPU, meta device), and a tiny config of the same family loads FP8 experts and serves on the CPU."""
import pytest
import torch

from lowbit.serve.layers.moe import MoeExperts, SparseMoe
from lowbit.serve.models import Qwen3MoeForCausalLM, model_class
from lowbit.testing.dummy_weights import PRESETS, QWEN3_30B_A3B, _linear_shape, dummy_checkpoint

TINY_MOE = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                vocab_size=256, max_position_embeddings=256, dtype="float32", mlp_only_layers=[1])


def test_preset_is_qwen3_30b_a3b():
    c = PRESETS["qwen3-30b-a3b"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"],
            c["moe_intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == \
        (2048, 48, 128, 8, 768, 32, 4, 151936)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4_awq"])
def test_preset_names_and_shapes_fit_the_served_model(fmt):
    ckpt = dummy_checkpoint(fmt, QWEN3_30B_A3B, device="cpu")
    with torch.device("meta"):
        model = model_class(ckpt.config)(ckpt.config)
    assert isinstance(model, Qwen3MoeForCausalLM)
    names = ckpt.tensors().names
    params = {n for n, _ in model.named_parameters()}
    assert params <= names, sorted(params - names)[:5]  # norms, router gates, embeddings
    assert ckpt.layer_algo("model.layers.47.mlp.gate") is None  # the router stays 16-bit
    blocks = [m for m in model.modules() if isinstance(m, SparseMoe)]
    assert len(blocks) == 48
    for name, module in model.named_modules():
        if isinstance(module, MoeExperts):
            for e in (0, 127):
                for part, shape in zip(module.part_names, [(768, 2048), (768, 2048), (2048, 768)]):
                    assert f"{name}.{e}.{part}.weight" in names and _linear_shape(QWEN3_30B_A3B,
                                                                                  f"{name}.{e}.{part}") == shape
    assert not any(".mlp.gate_proj." in n for n in names)  # every layer sparse: no dense MLP


def test_tiny_listing_equals_what_is_drawn():
    tensors = dummy_checkpoint("fp8", TINY_MOE, device="cpu").tensors()
    modules = {name.rsplit(".", 1)[0] for name in tensors}
    assert "model.layers.1.mlp.gate_proj" in modules and "model.layers.0.mlp.experts.3.down_proj" in modules
    for module in modules:
        drawn = tensors.__class__(tensors.ckpt)._draw_module(module)
        listed = {name.rsplit(".", 1)[1] for name in tensors if name.rsplit(".", 1)[0] == module}
        assert set(drawn) == listed, (module, sorted(drawn), sorted(listed))


def test_tiny_fp8_dummy_serves_on_cpu():
    """FP8 experts from the dummy checkpoint load (gate and up drawn with their own weight scales: per-row scales)
    and a request served alone gives the tokens it gives in a batch."""
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine
    from lowbit.bench.serve_bench import DummyTokenizer, greedy

    ckpt = dummy_checkpoint("fp8", TINY_MOE, device="cpu", std=0.2)
    engine = Engine(ckpt.path, EngineConfig(max_batch_size=4, max_num_tokens=64, device="cpu", dtype="float32",
                                            num_kv_blocks=64), ckpt=ckpt, tokenizer=DummyTokenizer())
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.fp8.w13_scale.shape == (4, 64)
    assert not torch.equal(experts.fp8.w13_scale[:, 0], experts.fp8.w13_scale[:, 32])  # gate's vs up's
    prompts = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (3, 21, 40)]
    together = greedy(engine, prompts, 4)
    assert together[1] == greedy(engine, prompts[1:2], 4)[0] and all(len(t) == 4 for t in together)


def test_tiny_int4_dummy_serves_on_cpu():
    """INT4 experts from the dummy checkpoint (group 128: hidden and moe_intermediate of 128) load packed, without
    pre_quant_scale (ones), and a request served alone gives the tokens it gives in a batch."""
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine
    from lowbit.bench.serve_bench import DummyTokenizer, greedy

    tiny = dict(TINY_MOE, hidden_size=128, intermediate_size=128, moe_intermediate_size=128)
    ckpt = dummy_checkpoint("int4_awq", tiny, device="cpu", std=0.2)
    engine = Engine(ckpt.path, EngineConfig(max_batch_size=4, max_num_tokens=64, device="cpu", dtype="float32",
                                            num_kv_blocks=64), ckpt=ckpt, tokenizer=DummyTokenizer())
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.uint8 and tuple(experts.w13.shape) == (4, 128, 128)
    assert experts.int4.w13_scale.shape == (4, 256, 1) and bool((experts.int4.w2_smooth == 1).all())
    prompts = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (3, 21, 40)]
    together = greedy(engine, prompts, 4)
    assert together[1] == greedy(engine, prompts[1:2], 4)[0] and all(len(t) == 4 for t in together)


def test_tiny_nvfp4_dummy_serves_on_cpu():
    """NVFP4 experts from the dummy checkpoint load weight-only (codes and e4m3 block scales as drawn, one global
    scale per row), and a request served alone gives the tokens it gives in a batch."""
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine
    from lowbit.bench.serve_bench import DummyTokenizer, greedy

    ckpt = dummy_checkpoint("nvfp4", TINY_MOE, device="cpu", std=0.2)
    engine = Engine(ckpt.path, EngineConfig(max_batch_size=4, max_num_tokens=64, device="cpu", dtype="float32",
                                            num_kv_blocks=64), ckpt=ckpt, tokenizer=DummyTokenizer())
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.uint8 and tuple(experts.w13.shape) == (4, 64, 32)
    assert experts.nvfp4.w13_block.shape == (4, 64, 4) and experts.nvfp4.w2_global.shape == (4, 64)
    prompts = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (3, 21, 40)]
    together = greedy(engine, prompts, 4)
    assert together[1] == greedy(engine, prompts[1:2], 4)[0] and all(len(t) == 4 for t in together)


def test_tiny_w8a8_sq_dummy_serves_on_cpu():
    """INT8 SmoothQuant experts from the dummy checkpoint load as int8 with a scale per output row, each expert's
    input scale and pre_quant_scale, and a request served alone gives the tokens it gives in a batch."""
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine
    from lowbit.bench.serve_bench import DummyTokenizer, greedy

    ckpt = dummy_checkpoint("w8a8_sq", TINY_MOE, device="cpu", std=0.2)
    engine = Engine(ckpt.path, EngineConfig(max_batch_size=4, max_num_tokens=64, device="cpu", dtype="float32",
                                            num_kv_blocks=64), ckpt=ckpt, tokenizer=DummyTokenizer())
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.int8 and tuple(experts.w13.shape) == (4, 64, 64)
    assert experts.int8.w13_scale.shape == (4, 64) and experts.int8.a2_scale.shape == (4,)
    assert experts.int8.w13_smooth.shape == (4, 64) and experts.int8.w2_smooth.shape == (4, 32)
    prompts = [[(5 * i + n) % 250 + 3 for i in range(n)] for n in (3, 21, 40)]
    together = greedy(engine, prompts, 4)
    assert together[1] == greedy(engine, prompts[1:2], 4)[0] and all(len(t) == 4 for t in together)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4_awq", "nvfp4", "w8a8_sq"])
def test_qwen3_moe_kernels_and_graphs_match_reference_path_on_gpu(fmt):
    from lowbit.bench import serve_bench as bench

    res = bench.check_format(bench.parse(["--check-layers", "2", "--model", "qwen3-30b-a3b", "--phases", "check"]),
                             fmt)
    assert res["graph_used"] and res["pass"], res
