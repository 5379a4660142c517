"""The Gemma-3-12B dummy preset: the dummy checkpoint lists every tensor the Gemma model loads, a tiny engine of the
family runs on the CPU, and the full preset has Gemma 3 12B's parameter count."""
import pytest
import torch

from lowbit.bench import serve_bench
from lowbit.serve.models.gemma import Gemma3ForCausalLM
from lowbit.testing.dummy_weights import GEMMA_3_12B


def test_tiny_dummy_gemma_engine_generates_on_cpu():
    args = serve_bench.parse(["--tiny", "--device", "cpu", "--model", "gemma-3-12b", "--phases", "check,formats"])
    for fmt in ("bf16", "fp8"):
        engine = serve_bench.build_engine(args, fmt, max_batch_size=4, num_kv_blocks=64)
        assert type(engine.runner.model) is Gemma3ForCausalLM
        tokens = serve_bench.greedy(engine, serve_bench.random_prompts(2, 20, 512, seed=3), 4)
        assert [len(t) for t in tokens] == [4, 4]


def test_gemma_preset_has_gemma_3_12b_shapes():
    with torch.device("meta"):
        model = Gemma3ForCausalLM(GEMMA_3_12B)
    from lowbit.serve.layers.linear import Linear

    n = sum(p.numel() for p in model.parameters())  # embeddings and norms; linears get their weights at load
    n += sum(m.in_features * m.out_features for name, m in model.named_modules()
             if isinstance(m, Linear) and name != "lm_head")  # lm_head: tied; q/k/v, gate/up: their merged Linear
    assert 11.5e9 < n < 12.5e9, n
    kinds = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert kinds.count(None) == 8 and kinds.count(1024) == 40  # every 6th layer global


def test_hf_phase_refused_for_other_presets(capsys):
    with pytest.raises(SystemExit):
        serve_bench.parse(["--model", "gemma-3-12b"])
    assert "hf phase" in capsys.readouterr().err
