"""INT4 AWQ and W8A8 SmoothQuant of a grouped-query-attention Llama exported as compressed-tensors: o_proj is
re-smoothed with one scale per KV group so it folds into v_proj; the library decompresses every weight to lowbit's
(folded) weight, lowbit reads it back, its logits stay as close to the float model as the modelopt checkpoint's, and
`lowbit convert` of a modelopt GQA checkpoint (no float weights) is refused with one line."""
import copy
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from lowbit import checkpoint, formats
from lowbit.calibrate.kv_group_smooth import shared_scale
from lowbit.errors import UserError
from interop_fixtures import LINEARS, SMALL, ct_decompress, tiny_llama

pytest.importorskip("compressed_tensors")
pytest.importorskip("modelopt")

IDS = torch.tensor([[(37 * i + 5) % SMALL["vocab_size"] for i in range(32)]])
HEADS, KV_HEADS = SMALL["num_attention_heads"], SMALL["num_key_value_heads"]
HEAD_DIM = SMALL["hidden_size"] // HEADS
assert KV_HEADS < HEADS  # grouped-query attention is what this file tests


def test_shared_scale_is_the_geometric_mean_within_each_kv_group():
    s = torch.rand(HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0)) * 2 + 0.1
    out = shared_scale(s, HEADS, KV_HEADS).reshape(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    assert torch.equal(out, out[:, :1].expand_as(out))
    want = s.reshape(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).prod(dim=1) ** (KV_HEADS / HEADS)
    torch.testing.assert_close(out[:, 0], want, rtol=1e-5, atol=0)
    already = out.reshape(-1)
    torch.testing.assert_close(shared_scale(already, HEADS, KV_HEADS), already, rtol=1e-6, atol=0)


def _logits(path) -> torch.Tensor:
    with torch.no_grad():
        return checkpoint.load_reference_model(path)[0](IDS).logits


def _module(tensors: dict, module: str) -> dict:
    return {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}


@pytest.fixture(scope="module", params=["int4_awq", "w8a8_sq"])
def exported(request, tmp_path_factory):
    """One calibration of a tiny GQA Llama, exported three ways: modelopt as calibrated ("mo"), modelopt after the
    per-KV-group o_proj smoothing ("shared"), and compressed-tensors ("ct", which applies that smoothing itself)."""
    from transformers import AutoTokenizer

    from lowbit.calibrate.kv_group_smooth import share_o_proj_smoothing
    from lowbit.calibrate.loop import calibrate
    from lowbit.models import DEFAULT_MODEL, resolve
    from lowbit.quantize.export import export
    from lowbit.recipe import load_recipe

    recipe = load_recipe(request.param)
    recipe = replace(recipe, group_size=32) if recipe.group_size else recipe
    model = tiny_llama()
    with torch.no_grad():
        float_logits = model(IDS).logits
    calibrate(model, recipe, [[(11 * i + 5 + j) % 1000 for i in range(32)] for j in range(2)])
    shared, ct = copy.deepcopy(model), copy.deepcopy(model)
    assert len(share_o_proj_smoothing(shared)) == SMALL["num_hidden_layers"]
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))
    tmp = tmp_path_factory.mktemp(request.param)
    export(model, tokenizer, recipe, tmp / "mo", source="tiny")
    export(shared, tokenizer, recipe, tmp / "shared", source="tiny")
    export(ct, tokenizer, recipe, tmp / "ct", source="tiny", export_format="compressed-tensors")
    return tmp, float_logits


def test_modelopt_gives_o_proj_scales_that_differ_within_a_kv_group(exported):
    tmp, _ = exported
    s = checkpoint.read(tmp / "mo").tensors()["model.layers.0.self_attn.o_proj.pre_quant_scale"].float()
    grouped = s.reshape(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    assert not torch.equal(grouped, grouped[:, :1].expand_as(grouped))  # what the export has to deal with
    s = checkpoint.read(tmp / "shared").tensors()["model.layers.0.self_attn.o_proj.pre_quant_scale"].float()
    grouped = s.reshape(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    assert torch.equal(grouped, grouped[:, :1].expand_as(grouped))


def test_library_decompresses_to_lowbit_weights(exported):
    from compressed_tensors.quantization import QuantizationConfig

    tmp, _ = exported
    qc = json.loads((tmp / "ct" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    shared, on_disk = checkpoint.read(tmp / "shared"), load_file(tmp / "ct" / "model.safetensors")
    assert not any(k.endswith("pre_quant_scale") for k in on_disk)
    original = shared.tensors()
    for layer in range(SMALL["num_hidden_layers"]):
        for leaf in LINEARS:
            module = f"model.layers.{layer}.{leaf}"
            ours = shared.layer_format(module).dequantize(_module(original, module))
            nxt = {"self_attn.v_proj": "self_attn.o_proj", "mlp.up_proj": "mlp.down_proj"}.get(leaf)
            if nxt is not None:  # took the next linear's pre_quant_scale in its rows
                s = original[f"model.layers.{layer}.{nxt}.pre_quant_scale"].float()
                ours = ours * (s.reshape(KV_HEADS, -1, HEAD_DIM)[:, 0].reshape(-1, 1) if "v_proj" in leaf else
                               s.reshape(-1, 1))
            # folded rows: q * (scale * s) on disk vs (q * scale) * s here, one fp32 rounding apart
            torch.testing.assert_close(ct_decompress(qc, on_disk, module), ours, rtol=1e-6 if nxt else 0, atol=0,
                                       msg=module)


def test_lowbit_reads_it_back_with_the_float_models_accuracy(exported):
    tmp, float_logits = exported
    back = checkpoint.read(tmp / "ct")
    assert back.layer_format("model.layers.1.self_attn.o_proj") is checkpoint.read(tmp / "mo").layer_format(
        "model.layers.1.self_attn.o_proj")
    ct, shared, mo = _logits(tmp / "ct"), _logits(tmp / "shared"), _logits(tmp / "mo")
    # same quantized model as "shared": the fold reorders fp32 products, and W8A8's int8 input rounding may flip on
    # a value that sits on a rounding boundary (one input step)
    assert (ct - shared).abs().max() <= 1e-3 * shared.abs().max()
    # vs the modelopt checkpoint of the same calibration: only o_proj's smoothing differs, so the export's error
    # against the float model stays within 1.25 x the modelopt checkpoint's (max abs logit error)
    err_ct, err_mo = (ct - float_logits).abs().max(), (mo - float_logits).abs().max()
    assert err_ct <= 1.25 * err_mo, (err_ct, err_mo)
    assert not torch.equal(ct, mo)  # the export did change o_proj


def test_convert_of_a_modelopt_gqa_checkpoint_is_refused_with_one_line(exported, tmp_path):
    from lowbit.convert_cli import convert

    tmp, _ = exported
    with pytest.raises(UserError, match="o_proj: its pre_quant_scale differs .* --export-format compressed-tensors") \
            as err:
        convert(tmp / "mo", tmp_path / "out", "compressed-tensors")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
