"""W4A16 INT4 experts of tiny Qwen3-MoE and Mixtral checkpoints (per-expert AWQ pre_quant_scales, experts quantized
by lowbit's format registry in modelopt's per-expert layout, the rest 16-bit): the engine against the reference
reader, and the loader's refusal of gate and up that do not share their smoothing."""
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3MoeConfig

from lowbit.formats.w4a16_awq import W4A16_AWQ
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.auto_write import write_mixed
from lowbit.serve import LLM
from test_serve_engine import check_against_reference

torch.set_num_threads(1)
EXPERTS, GROUP = 4, 32
SHAPES = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.05,
              tie_word_embeddings=False, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": (Qwen3MoeConfig(moe_intermediate_size=32, num_experts=EXPERTS, **SHAPES), "mlp.experts",
                  ("gate_proj", "up_proj", "down_proj")),
    "mixtral": (MixtralConfig(**dict(SHAPES, intermediate_size=32), num_local_experts=EXPERTS),
                "block_sparse_moe.experts", ("w1", "w3", "w2")),
}


def int4_experts_checkpoint(out, family: str, unmergeable: bool = False):
    """A float tiny model of `family` with every expert linear W4A16_AWQ (group 32), gate and up sharing a random
    pre_quant_scale per expert (unmergeable: expert 1's up gets its own), down its own."""
    torch.manual_seed(0)
    cfg, experts, parts = CONFIGS[family]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))
    src = out.parent / f"{out.name}-float"  # transformers' own per-expert names and weights
    model.save_pretrained(src)
    float_tensors = load_file(src / "model.safetensors")
    shutil.rmtree(src)
    g = torch.Generator().manual_seed(1)
    layer_tensors, entries = {}, {}
    for layer in range(cfg.num_hidden_layers):
        for e in range(EXPERTS):
            base = f"model.layers.{layer}.{experts}.{e}"
            smooth_in = 0.5 + torch.rand(cfg.hidden_size, generator=g)
            for part in parts:
                w = float_tensors[f"{base}.{part}.weight"]
                smooth = smooth_in if part != parts[2] else 0.5 + torch.rand(w.shape[1], generator=g)
                if unmergeable and e == 1 and part == parts[1]:
                    smooth = smooth * 1.5
                layer_tensors[f"{base}.{part}"] = W4A16_AWQ.quantize(w, group=GROUP, smooth=smooth.clone())
                entries[f"{base}.{part}"] = {"quant_algo": W4A16_AWQ.name, "group_size": GROUP}
    recipe = {"name": "int4_awq", "quant_algo": W4A16_AWQ.name}
    return write_mixed(model, tok, layer_tensors, entries, out, source=family, recipe=recipe)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_matches_reader(family, tmp_path):
    path = int4_experts_checkpoint(tmp_path / family, family)
    llm = check_against_reference(path, max_num_tokens=16)
    layer = llm.engine.runner.model.model.layers[0]
    experts = getattr(layer, layer.mlp_name).experts
    assert experts.w13.dtype == torch.uint8 and experts.int4.w13_scale.shape == (EXPERTS, 2 * 32, 64 // GROUP)
    assert experts.int4.w13_smooth.unique().numel() > 64  # each expert's own smoothing reached the layer


def test_gate_and_up_with_different_smoothing_are_refused(tmp_path):
    path = int4_experts_checkpoint(tmp_path / "split", "qwen3_moe", unmergeable=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1: gate and up have different input"):
        LLM(str(path), num_kv_blocks=16)
