"""Rotation pass (calibrate/rotate.py): float logits unchanged within fp32 tolerance on tiny models and the
embedded model; rotated and quantized checkpoints keep the format and match modelopt's fake quant in the reader."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from lowbit.calibrate.data import builtin_texts, load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.calibrate.rotate import randomized_hadamard, rotate, rotate_residual, walsh_hadamard
from lowbit.checkpoint import load_reference_model, read
from lowbit.errors import UserError
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe, recipe_from_dict

torch.set_num_threads(1)
# fp32 weights rotated in float64 and cast back: each weight moves by ~1 ulp, the logits by ~1e-7 relative per
# layer (measured 5e-7 on the tiny model, 2e-6 on the 30-layer embedded model); a missed or wrong fold moves
# them by O(1).
TINY_REL = 1e-5
EMBEDDED_REL = 2e-5
READER_REL = 1e-5  # reader vs modelopt fake quant, weight-only INT4 (as tests/test_quantize_families.py)
# FP8 with FP8 KV: a rotated weight now and then lands within an ulp of an e4m3 rounding tie, and modelopt's fake
# quant (w * 448/amax) and its export (w / (amax/448)) break it differently (docs/accuracy.md, format facts):
# measured one layer at 4.5e-4, the others <= 2.5e-7. Downstream the 1e-4 difference flips FP8 K/V roundings, so
# the whole model is compared to the quantization noise itself (the float model's distance to the fake quant);
# a wrong lm_head or norm would be O(1) off.
LAYER_REL_FP8 = 1e-3
NOISE_FRACTION_FP8 = 0.25
SMALL = dict(vocab_size=49152, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, initializer_range=0.05, max_position_embeddings=256)


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def tiny(family: str = "llama", tied: bool = True):
    """A tiny random model whose RMSNorm weights are far from ones (so a missing fold shows)."""
    torch.manual_seed(0)
    cls = LlamaConfig if family == "llama" else Qwen2Config
    model = AutoModelForCausalLM.from_config(cls(**SMALL, tie_word_embeddings=tied), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("n", [16, 64, 96, 576])
def test_rotation_is_orthogonal(n):
    q = randomized_hadamard(n, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if n & (n - 1) == 0:  # a pure randomized Walsh-Hadamard: every entry +-1/sqrt(n)
        assert torch.allclose(q.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))
        assert torch.allclose(walsh_hadamard(n) @ walsh_hadamard(n).T, torch.eye(n, dtype=torch.float64))
    assert not torch.allclose(q, randomized_hadamard(n, seed=4))


@pytest.mark.parametrize("family,tied,heads", [("llama", True, True), ("llama", True, False), ("qwen2", False, True)])
def test_float_logits_unchanged_tiny(family, tied, heads):
    model = tiny(family, tied)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    emb_before = model.model.embed_tokens.weight.clone()
    with torch.no_grad():
        ref = model(ids).logits
    rotate(model, seed=0, heads=heads)
    with torch.no_grad():
        got = model(ids).logits
    err = rel_l2(got, ref)
    print(f"{family} tied={tied} heads={heads}: logits rel-L2 {err:.1e}")
    assert err < TINY_REL
    assert rel_l2(model.model.embed_tokens.weight, emb_before) > 0.5  # the weights did move
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(torch.all(m.weight == 1) for n, m in model.named_modules() if n.endswith("norm"))


def test_rotation_without_fold_is_refused():
    with pytest.raises(ValueError, match="fold"):
        rotate_residual(tiny())


def test_unsupported_family_is_refused():
    from transformers import GemmaConfig

    model = AutoModelForCausalLM.from_config(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1, head_dim=16))
    with pytest.raises(UserError, match="gemma"):
        rotate(model)


def test_float_logits_unchanged_embedded(embedded_model_dir):
    model, tok = load_float_model(embedded_model_dir)
    ids = torch.tensor(token_batches(tok, builtin_texts("boolq", "heldout"), 1, 128, seed=0))
    with torch.no_grad():
        ref = model(ids).logits
    rotate(model)
    with torch.no_grad():
        got = model(ids).logits
    err = rel_l2(got, ref)
    print(f"embedded model: logits rel-L2 {err:.1e}, max abs {(got - ref).abs().max():.1e}")
    assert err < EMBEDDED_REL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("bad,msg", [({"rotation": "givens"}, "'rotation'"),
                                     ({"rotation_args": {"seed": 1}}, "without a rotation"),
                                     ({"rotation": "hadamard", "rotation_args": {"seed": "x"}}, "rotation_args.seed"),
                                     ({"rotation": "hadamard", "rotation_args": {"heads": 1}}, "rotation_args.heads"),
                                     ({"rotation": "hadamard", "rotation_args": {"turns": 2}}, "unknown argument")])
def test_bad_rotation_values(bad, msg):
    with pytest.raises(UserError, match=msg) as e:
        recipe_from_dict({**load_recipe("fp8").to_dict(), **bad})
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module", params=["fp8", "int4_rtn"])
def rotated_run(request, tmp_path_factory):
    src = tmp_path_factory.mktemp("tiny")
    tiny("llama", tied=True).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    base = with_calibration(load_recipe(request.param), num_samples=4, seq_len=64)
    recipe = recipe_from_dict({**base.to_dict(), "rotation": "hadamard"}, source=request.param)
    model, tok = load_float_model(src)
    heldout = token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0)
    with torch.no_grad():
        float_logits = model(torch.tensor(heldout)).logits
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 4, 64, seed=0))
    layer_io = {}
    with torch.no_grad():
        fake_quant_logits = model(torch.tensor(heldout)).logits
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                x = torch.randn(2, 5, module.in_features, generator=torch.Generator().manual_seed(1))
                layer_io[name] = (x, module(x))
    out = tmp_path_factory.mktemp("ckpt") / f"tiny-{request.param}-rot"
    export(model, tok, recipe, out, source="tiny")
    return {"recipe": recipe, "out": out, "heldout": heldout, "fake_quant_logits": fake_quant_logits,
            "float_logits": float_logits, "layer_io": layer_io}


def test_rotated_checkpoint_format(rotated_run):
    out = rotated_run["out"]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # untied, left unquantized
        assert torch.all(f.get_tensor("model.norm.weight") == 1)
        assert torch.all(f.get_tensor("model.layers.1.input_layernorm.weight") == 1)
    assert not any(k.startswith("lm_head.") and "scale" in k for k in keys)
    ckpt = read(out)
    assert ckpt.layer_algo("lm_head") is None
    assert ckpt.layer_algo("model.layers.1.mlp.down_proj") is not None
    assert "model.layers.0.self_attn.k_proj.k_scale" in keys or not rotated_run["recipe"].kv_cache


def test_rotated_reader_matches_modelopt_fake_quant(rotated_run):
    model, _ = load_reference_model(rotated_run["out"])
    with torch.no_grad():
        logits = model(torch.tensor(rotated_run["heldout"])).logits
    ref = rotated_run["fake_quant_logits"]
    err, noise = rel_l2(logits, ref), rel_l2(rotated_run["float_logits"], ref)
    with torch.no_grad():
        layer_errs = sorted(rel_l2(model.get_submodule(n)(x), y) for n, (x, y) in rotated_run["layer_io"].items())
    print(f"{rotated_run['recipe'].name} + rotation: reader vs modelopt fake quant logits rel-L2 {err:.1e} "
          f"(float vs fake quant {noise:.1e}); per linear: median {layer_errs[len(layer_errs) // 2]:.1e}, "
          f"max {layer_errs[-1]:.1e}")
    if rotated_run["recipe"].kv_cache is None:
        assert err < READER_REL and layer_errs[-1] < READER_REL
    else:
        assert err < NOISE_FRACTION_FP8 * noise
        assert layer_errs[-1] < LAYER_REL_FP8 and layer_errs[len(layer_errs) // 2] < READER_REL


def test_engine_serves_rotated_checkpoint(rotated_run):
    from test_serve_engine import check_against_reference

    check_against_reference(rotated_run["out"], max_num_tokens=16)
