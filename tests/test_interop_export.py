"""lowbit FP8 checkpoints rewritten as compressed-tensors: the library parses the config and decompresses every
weight to lowbit's dequantized weight exactly, and lowbit reads the result back to the same logits."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lowbit import checkpoint, formats
from lowbit.checkpoint.interop.export_compressed_tensors import ignore_entry, rewrite
from lowbit.errors import UserError
from interop_fixtures import LINEARS, SMALL, ct_decompress, lowbit_fp8_checkpoint

pytest.importorskip("compressed_tensors")

MODULES = [f"model.layers.{i}.{m}" for i in range(SMALL["num_hidden_layers"]) for m in LINEARS]
IDS = torch.tensor([[5, 17, 300, 42, 7, 901, 64, 3]])


@pytest.mark.parametrize("fmt", [formats.FP8, formats.FP8_PER_CHANNEL_PER_TOKEN])
def test_round_trip_through_compressed_tensors(fmt, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    src, dst = tmp_path / "lowbit", tmp_path / "ct"
    lowbit_fp8_checkpoint(src, fmt, exclude=("lm_head", "model.layers.1.mlp.down*"))
    shutil.copytree(src, dst)
    rewrite(dst)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)  # the library accepts the config as it stands
    assert not (dst / "hf_quant_config.json").exists() and qc["ignore"][0] == "lm_head"
    original, on_disk = checkpoint.read(src), load_file(dst / "model.safetensors")
    for module in MODULES:
        if module == "model.layers.1.mlp.down_proj":
            assert torch.equal(on_disk[f"{module}.weight"], original.tensors()[f"{module}.weight"])
            continue
        ours = fmt.dequantize({k.rsplit(".", 1)[1]: v for k, v in original.tensors().items()
                               if k.rsplit(".", 1)[0] == module})
        assert torch.equal(ct_decompress(qc, on_disk, module), ours), module
    assert on_disk["model.layers.0.self_attn.k_scale"].item() == pytest.approx(0.02)
    back = checkpoint.read(dst)
    assert back.layer_format("model.layers.1.mlp.down_proj") is None and back.kv_format is formats.KV_FP8
    assert back.layer_format("model.layers.1.mlp.up_proj") is fmt
    with torch.no_grad():
        a = checkpoint.load_reference_model(src)[0](IDS).logits
        b = checkpoint.load_reference_model(dst)[0](IDS).logits
    assert torch.equal(a, b)


def test_ignore_entries_match_what_exclude_modules_match():
    import re

    from lowbit.formats.layers import excluded

    names = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.10.mlp.gate_proj", "lm_head"]
    for pattern in ["lm_head", "model.layers.0.mlp.gate*", "*.up_proj"]:
        entry = ignore_entry(pattern)
        ct = [n for n in names if (re.match(entry[3:], n) if entry.startswith("re:") else n == entry)]
        assert ct == [n for n in names if excluded(n, pattern)], pattern


def test_unquantized_checkpoint_is_refused_with_one_line(tmp_path):
    from interop_fixtures import tiny_llama

    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(UserError, match="unquantized checkpoint has no compressed-tensors form") as err:
        rewrite(tmp_path)
    assert "\n" not in str(err.value)


def test_quantize_export_format_compressed_tensors_end_to_end(tmp_path):
    """modelopt calibrates and exports a tiny Llama twice, once rewritten as compressed-tensors: same logits."""
    import copy

    pytest.importorskip("modelopt")
    from transformers import AutoTokenizer

    from interop_fixtures import tiny_llama
    from lowbit.calibrate.loop import calibrate
    from lowbit.models import DEFAULT_MODEL, resolve
    from lowbit.quantize.export import export
    from lowbit.recipe import load_recipe

    recipe = load_recipe("fp8")
    model = tiny_llama()
    calibrate(model, recipe, [[(11 * i + 5) % 1000 for i in range(32)] for _ in range(2)])
    twin = copy.deepcopy(model)
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))
    export(model, tokenizer, recipe, tmp_path / "mo", source="tiny")
    export(twin, tokenizer, recipe, tmp_path / "ct", source="tiny", export_format="compressed-tensors")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["weights"]["strategy"] == \
        "tensor"
    with torch.no_grad():
        a = checkpoint.load_reference_model(tmp_path / "mo")[0](IDS).logits
        b = checkpoint.load_reference_model(tmp_path / "ct")[0](IDS).logits
    assert torch.equal(a, b)


def test_export_format_checked_before_calibration():
    from lowbit.quantize.api import check_export_format
    from lowbit.recipe import available, load_recipe

    for name in available():  # every shipped recipe has a compressed-tensors form
        check_export_format("compressed-tensors", load_recipe(name))
    with pytest.raises(UserError, match="'gguf' is not one of"):
        check_export_format("gguf", load_recipe("fp8"))
