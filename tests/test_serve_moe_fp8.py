"""FP8 (per-tensor) experts of a tiny Qwen3-MoE through calibration, export and serving: lowbit's reader against
modelopt's fake-quant model, the engine against the reader (also with input scales that differ from expert to
expert, which modelopt's export does not write but a checkpoint may hold), and the loader's refusals."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from lowbit.calibrate.data import builtin_texts, load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import load_reference_model
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe
from lowbit.serve import LLM
from test_serve_engine import check_against_reference

torch.set_num_threads(1)
EXPERTS = 8
READER_REL = 1e-5  # as tests/test_quantize_families.py: the same values in another order (rel-L2 of the logits)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(checkpoint, held-out tokens, modelopt's fake-quant logits on them)."""
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("qwen3_moe")
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.05,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    recipe = with_calibration(load_recipe("fp8"), num_samples=4, seq_len=64)
    model, tok = load_float_model(src)
    heldout = token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0)
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant_logits = model(torch.tensor(heldout)).logits
    out = tmp_path_factory.mktemp("ckpt") / "qwen3_moe-fp8"
    export(model, tok, recipe, out, source="qwen3_moe")
    return out, heldout, fake_quant_logits


def rewrite(src, dst, edit):
    """A copy of checkpoint src at dst with edit(tensors) applied to its tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_reader_matches_modelopt_fake_quant(exported):
    out, heldout, fake_quant_logits = exported
    model, _ = load_reference_model(out)
    with torch.no_grad():
        logits = model(torch.tensor(heldout)).logits
    err = ((logits - fake_quant_logits).norm() / fake_quant_logits.norm()).item()
    assert err < READER_REL, err


def test_engine_matches_reader(exported):
    llm = check_against_reference(exported[0], max_num_tokens=16)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.fp8.a13_scale.shape == (EXPERTS,)


def test_engine_matches_reader_with_per_expert_input_scales(exported, tmp_path):
    """Each expert's own input scales (gate/up and down), from a quarter to twice modelopt's shared one: some clip."""
    def spread(tensors):
        for name in list(tensors):
            if ".experts." in name and name.endswith("input_scale"):
                e = int(name.split(".experts.")[1].split(".")[0])
                tensors[name] = tensors[name] * (0.25 + e * 1.75 / (EXPERTS - 1))

    path = rewrite(exported[0], tmp_path / "spread", spread)
    llm = check_against_reference(path, max_num_tokens=16)
    scales = llm.engine.runner.model.model.layers[0].mlp.experts.fp8.a13_scale
    assert scales.unique().numel() == EXPERTS


def test_gate_and_up_with_different_input_scales_are_refused(exported, tmp_path):
    def split(tensors):
        name = "model.layers.1.mlp.experts.5.up_proj.input_scale"
        tensors[name] = tensors[name] * 2

    path = rewrite(exported[0], tmp_path / "split", split)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5: gate and up have different input"):
        LLM(str(path), num_kv_blocks=16)


def test_experts_of_another_format_are_refused(exported, tmp_path):
    """One expert linear left unquantized beside FP8 ones: one line naming the experts."""
    def unquantize(tensors):
        base = "model.layers.0.mlp.experts.2.down_proj"
        tensors[f"{base}.weight"] = tensors[f"{base}.weight"].float() * tensors.pop(f"{base}.weight_scale")
        del tensors[f"{base}.input_scale"]

    path = rewrite(exported[0], tmp_path / "mixed", unquantize)
    config = json.loads((path / "hf_quant_config.json").read_text())
    config["quantization"]["exclude_modules"].append("model.layers.0.mlp.experts.2.down_proj")
    (path / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"experts of model\.layers\.0\.mlp\.experts mix quantization formats"):
        LLM(str(path), num_kv_blocks=16)
