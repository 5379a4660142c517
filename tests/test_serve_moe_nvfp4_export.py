"""modelopt 0.47's NVFP4 export of a tiny Qwen3-MoE (transformers' fused experts, calibrated on the CPU), served with
NVFP4 experts weight-only: relabelled W4A16_NVFP4 (input scales dropped) the engine matches the reference reader;
as exported (NVFP4, input scales on disk) the experts load the same codes and scales, unused input scales aside."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from lowbit import formats
from lowbit.calibrate.data import load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe
from lowbit.serve import LLM, SamplingParams
from test_serve_engine import check_against_reference

torch.set_num_threads(1)
EXPERTS = 4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("qwen3_moe")
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.05)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    recipe = with_calibration(load_recipe("nvfp4"), num_samples=4, seq_len=64)
    model, tok = load_float_model(src)
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    out = tmp_path_factory.mktemp("ckpt") / "qwen3_moe-nvfp4"
    export(model, tok, recipe, out, source="qwen3_moe")
    return out


def weight_only(path, out):
    """A copy of the checkpoint at path relabelled W4A16_NVFP4, every input_scale dropped."""
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith(".input_scale")}, out / "model.safetensors",
              metadata={"format": "pt"})
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        config = json.loads((out / name).read_text())
        if key in config:
            config[key]["quant_algo"] = formats.W4A16_NVFP4.name
            (out / name).write_text(json.dumps(config))
    return out


def experts_of(llm):
    layer = llm.engine.runner.model.model.layers[0]
    return getattr(layer, layer.mlp_name).experts


def test_export_lists_nvfp4_expert_linears(exported):
    tensors = load_file(exported / "model.safetensors")
    for e in range(EXPERTS):
        for part in ("gate_proj", "up_proj", "down_proj"):
            base = f"model.layers.0.mlp.experts.{e}.{part}"
            assert tensors[f"{base}.weight"].dtype == torch.uint8
            assert tensors[f"{base}.weight_scale"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.mlp.gate.weight" in tensors and "model.layers.0.mlp.gate.weight_scale" not in tensors


def test_weight_only_engine_matches_reader(exported, tmp_path):
    llm = check_against_reference(weight_only(exported, tmp_path / "w4a16"), max_num_tokens=16)
    assert experts_of(llm).nvfp4 is not None and experts_of(llm).w13.dtype == torch.uint8


def test_nvfp4_experts_load_weight_only(exported, tmp_path):
    """The NVFP4 checkpoint's experts hold the same tensors as the weight-only copy's, and it generates."""
    nvfp4 = LLM(str(exported), num_kv_blocks=16)
    ref = experts_of(LLM(str(weight_only(exported, tmp_path / "w4a16")), num_kv_blocks=16))
    got = experts_of(nvfp4)
    assert torch.equal(got.w13, ref.w13) and torch.equal(got.w2, ref.w2)
    for a, b in zip(got.nvfp4, ref.nvfp4):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    out = nvfp4.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
