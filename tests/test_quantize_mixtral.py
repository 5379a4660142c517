"""Mixtral through modelopt's calibration and export (fp8, int4_awq, w8a8_sq; attention left 16-bit, so the experts
are what is compared): the checkpoint names the experts as Mixtral checkpoints do (`block_sparse_moe.experts.{e}.w1/w3/w2`,
while transformers 5's module is `mlp`), lowbit's reader against modelopt's fake-quant model, the engine against the
reader."""
import dataclasses
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MixtralConfig

from lowbit.calibrate.data import builtin_texts, load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import load_reference_model, read
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe
from test_serve_engine import check_against_reference
from test_serve_moe_fp8 import READER_REL

torch.set_num_threads(1)
EXPERTS = 4


@pytest.fixture(scope="module", params=["fp8", "int4_awq", "w8a8_sq"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("mixtral")
    cfg = MixtralConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                        initializer_range=0.05, tie_word_embeddings=False, num_local_experts=EXPERTS,
                        num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    recipe = dataclasses.replace(with_calibration(load_recipe(request.param), num_samples=4, seq_len=64),
                                 exclude=("lm_head", "*self_attn*"), kv_cache=None)
    model, tok = load_float_model(src)
    heldout = token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0)
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant_logits = model(torch.tensor(heldout)).logits
    out = tmp_path_factory.mktemp("ckpt") / f"mixtral-{request.param}"
    export(model, tok, recipe, out, source="mixtral")
    return out, heldout, fake_quant_logits


def test_experts_named_as_mixtral_checkpoints(exported):
    out = exported[0]
    ckpt = read(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    for e in range(EXPERTS):
        for part in ("w1", "w3", "w2"):
            assert f"model.layers.1.block_sparse_moe.experts.{e}.{part}.weight_scale" in names
            assert ckpt.layer_algo(f"model.layers.1.block_sparse_moe.experts.{e}.{part}") == ckpt.quant_algo
    assert "model.layers.1.block_sparse_moe.gate.weight" in names


def test_reader_matches_modelopt_fake_quant(exported):
    out, heldout, fake_quant_logits = exported
    model, _ = load_reference_model(out)
    with torch.no_grad():
        logits = model(torch.tensor(heldout)).logits
    err = ((logits - fake_quant_logits).norm() / fake_quant_logits.norm()).item()
    assert err < READER_REL, err


def test_engine_matches_reader(exported):
    llm = check_against_reference(exported[0], max_num_tokens=16)
    experts = llm.engine.runner.model.model.layers[0].block_sparse_moe.experts
    assert experts.w13.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8)
