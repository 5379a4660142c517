"""lowbit W8A8 SmoothQuant, INT4 (symmetric and zero-point) and NVFP4 checkpoints written as compressed-tensors: the
library decompresses every weight to lowbit's dequantized weight (after the pre_quant_scale fold), lowbit reads the
result back to the modelopt checkpoint's logits, and unfoldable pre_quant_scales are refused with one line."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit import checkpoint, formats
from lowbit.checkpoint.interop.export_compressed_tensors import rewrite
from lowbit.errors import UserError
from interop_fixtures import LINEARS, SMALL, copy_tokenizer, ct_decompress, tiny_llama

pytest.importorskip("compressed_tensors")

IDS = torch.tensor([[5, 17, 300, 42, 7, 901, 64, 3]])
HEAD_DIM = SMALL["hidden_size"] // SMALL["num_attention_heads"]
N_REP = SMALL["num_attention_heads"] // SMALL["num_key_value_heads"]


def _smooth(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.5  # in [0.5, 2)


def lowbit_checkpoint(out, fmt, smooth: bool, grouped_o: bool = True, kv_cache: bool = False):
    """A tiny Llama with every linear but lm_head in `fmt`, as modelopt lays it out. smooth: pre_quant_scales on
    every linear (one per norm for q/k/v and gate/up; o_proj's equal across a KV group unless grouped_o=False)."""
    model = tiny_llama()
    model.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    for layer in range(SMALL["num_hidden_layers"]):
        s_attn, s_mlp = _smooth(SMALL["hidden_size"], layer), _smooth(SMALL["hidden_size"], 10 + layer)
        s_down = _smooth(SMALL["intermediate_size"], 20 + layer)
        s_o = _smooth(SMALL["num_key_value_heads"] * HEAD_DIM, 30 + layer).reshape(-1, 1, HEAD_DIM)
        s_o = s_o.expand(-1, N_REP, -1).reshape(-1) if grouped_o else _smooth(SMALL["hidden_size"], 40 + layer)
        for leaf in LINEARS:
            name = f"model.layers.{layer}.{leaf}"
            s = {"o_proj": s_o, "down_proj": s_down}.get(leaf.rsplit(".", 1)[1], s_attn if "attn" in leaf else s_mlp)
            t = fmt.quantize(tensors.pop(f"{name}.weight"), x_amax=6.0, group=32, smooth=s if smooth else None)
            tensors.update({f"{name}.{k}": v for k, v in t.items()})
        if kv_cache:
            tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = torch.tensor(0.02)
            tensors[f"model.layers.{layer}.self_attn.v_proj.v_scale"] = torch.tensor(0.03)
    save_file({k: v.clone() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    quant = {"quant_algo": fmt.name, "exclude_modules": ["lm_head"],
             "kv_cache_quant_algo": formats.KV_FP8.name if kv_cache else None}
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    copy_tokenizer(out)


def _logits(path) -> torch.Tensor:
    with torch.no_grad():
        return checkpoint.load_reference_model(path)[0](IDS).logits


def _module(tensors: dict, module: str) -> dict:
    return {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}


CASES = [(formats.W4A16_AWQ, True, False), (formats.W4A16_ZP, False, False), (formats.W8A8_SQ_PER_CHANNEL, True, False),
         (formats.NVFP4, False, True), (formats.W4A16_NVFP4, False, False)]


@pytest.mark.parametrize("fmt,smooth,kv", CASES, ids=[c[0].name for c in CASES])
def test_export_decompresses_to_lowbit_weights_and_logits(fmt, smooth, kv, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    src, dst = tmp_path / "lowbit", tmp_path / "ct"
    lowbit_checkpoint(src, fmt, smooth, kv_cache=kv)
    shutil.copytree(src, dst)
    rewrite(dst)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
    original, on_disk = checkpoint.read(src).tensors(), load_file(dst / "model.safetensors")
    assert not any(k.endswith("pre_quant_scale") for k in on_disk)
    for layer in range(SMALL["num_hidden_layers"]):
        for leaf in LINEARS:
            module = f"model.layers.{layer}.{leaf}"
            ours = fmt.dequantize(_module(original, module))
            folded = smooth and leaf in ("self_attn.v_proj", "mlp.up_proj")
            if folded and leaf in ("self_attn.v_proj", "mlp.up_proj"):  # took o_proj's / down_proj's scale
                nxt = module.replace("v_proj", "o_proj").replace("up_proj", "down_proj")
                s = original[f"{nxt}.pre_quant_scale"].float()
                ours = ours * (s.reshape(-1, N_REP, HEAD_DIM)[:, 0].reshape(-1, 1) if "v_proj" in leaf else
                               s.reshape(-1, 1))
            theirs = ct_decompress(qc, on_disk, module)
            if fmt.kernel == "nvfp4":  # the library returns bf16(e2m1 * (scale / global)), global = 1 / scale_2
                assert theirs.dtype == torch.bfloat16 and (ours.bfloat16() != theirs).float().mean() < 1e-3, module
                torch.testing.assert_close(theirs.float(), ours, rtol=2**-8, atol=0, msg=module)
            else:  # folded rows: q * (s * c) on disk vs (q * s) * c here
                torch.testing.assert_close(theirs, ours, rtol=1e-6 if folded else 0, atol=0, msg=module)
    if kv:
        assert on_disk["model.layers.1.self_attn.v_scale"].item() == pytest.approx(0.03)
        assert qc["kv_cache_scheme"]["type"] == "float"
    back = checkpoint.read(dst)
    assert back.layer_format("model.layers.1.mlp.up_proj") is (
        formats.W8A8_SQ_PER_CHANNEL if fmt is formats.W8A8_SQ_PER_CHANNEL else fmt)
    a, b = _logits(src), _logits(dst)
    # fp32 model: the fold reorders fp32 products (x * s * w vs x * (s * w)); W8A8's int8 input rounding may flip
    # on a value that sits on a rounding boundary, one input step
    tol = 1e-3 if fmt is formats.W8A8_SQ_PER_CHANNEL else 1e-5
    assert (a - b).abs().max() <= tol * a.abs().max(), (a - b).abs().max()
    if not smooth:
        assert torch.allclose(a, b, rtol=0, atol=1e-5 * a.abs().max().item())


def test_o_proj_scale_that_differs_within_a_kv_group_is_refused(tmp_path):
    lowbit_checkpoint(tmp_path, formats.W4A16_AWQ, smooth=True, grouped_o=False)
    with pytest.raises(UserError, match="o_proj: its pre_quant_scale differs across the 2 query heads") as err:
        rewrite(tmp_path)
    assert "\n" not in str(err.value)


def test_o_proj_scale_with_an_fp8_kv_cache_is_refused(tmp_path):
    lowbit_checkpoint(tmp_path, formats.W8A8_SQ_PER_CHANNEL, smooth=True, kv_cache=True)
    with pytest.raises(UserError, match="FP8 KV cache"):
        rewrite(tmp_path)


@pytest.mark.parametrize("recipe_name,mha", [("int4_rtn", False), ("int4_awq", True), ("w8a8_sq", True)])
def test_quantize_export_end_to_end(recipe_name, mha, tmp_path):
    """modelopt calibrates a tiny Llama (multi-head attention where smoothing reaches o_proj) and exports it twice,
    once as compressed-tensors: the same logits within the fold's fp32 reordering."""
    import copy
    from dataclasses import replace

    pytest.importorskip("modelopt")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from lowbit.calibrate.loop import calibrate
    from lowbit.models import DEFAULT_MODEL, resolve
    from lowbit.quantize.export import export
    from lowbit.recipe import load_recipe

    recipe = load_recipe(recipe_name)
    recipe = replace(recipe, group_size=32) if recipe.group_size else recipe
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMALL, "num_key_value_heads": SMALL["num_attention_heads"] if mha else 2})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    calibrate(model, recipe, [[(11 * i + 5) % 1000 for i in range(32)] for _ in range(2)])
    twin = copy.deepcopy(model)
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))
    export(model, tokenizer, recipe, tmp_path / "mo", source="tiny")
    export(twin, tokenizer, recipe, tmp_path / "ct", source="tiny", export_format="compressed-tensors")
    if recipe_name != "int4_rtn":  # smoothing reached o_proj / down_proj, and the fold moved it
        assert any(k.endswith("o_proj.pre_quant_scale") for k in checkpoint.read(tmp_path / "mo").tensors())
    a, b = _logits(tmp_path / "mo"), _logits(tmp_path / "ct")
    assert (a - b).abs().max() <= 1e-3 * a.abs().max(), (a - b).abs().max()
