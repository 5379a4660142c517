"""`lowbit convert`: compressed-tensors (written by the library), AutoAWQ and lowbit checkpoints rewritten between
modelopt and compressed-tensors layouts; round trips give identical logits and tensors, refusals are one line."""
import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit import checkpoint, formats
from lowbit.cli import main
from lowbit.convert_cli import convert
from lowbit.errors import UserError
from interop_fixtures import compressed_tensors_checkpoint, int4_checkpoint

pytest.importorskip("compressed_tensors")

IDS = torch.tensor([[5, 17, 300, 42, 7, 901, 64, 3]])


def _logits(path) -> torch.Tensor:
    with torch.no_grad():
        return checkpoint.load_reference_model(path)[0](IDS).logits


@pytest.mark.parametrize("preset", ["W4A16", "W8A8_STATIC", "FP8_DYNAMIC", "NVFP4"])
def test_compressed_tensors_to_modelopt_and_back(preset, tmp_path):
    src, mo, ct = tmp_path / "src", tmp_path / "mo", tmp_path / "ct"
    compressed_tensors_checkpoint(src, preset)
    convert(src, mo, "modelopt")
    assert json.loads((mo / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == \
        formats.MIXED_PRECISION and "quantization_config" not in json.loads((mo / "config.json").read_text())
    convert(mo, ct, "compressed-tensors")
    a, b, c = _logits(src), _logits(mo), _logits(ct)
    assert torch.equal(a, b) and torch.equal(a, c)
    original, back = load_file(src / "model.safetensors"), load_file(ct / "model.safetensors")
    for name in [k for k in original if k.endswith(("weight_packed", "weight_zero_point")) or
                 (k.endswith(".weight") and original[k].dtype in (torch.int8, torch.float8_e4m3fn))]:
        assert torch.equal(back[name], original[name]), name
    for name in [k for k in original if k.endswith("scale")]:  # scales are kept in fp32; NVFP4's global scales
        # pass through their reciprocal (modelopt's weight_scale_2 / input_scale): within one fp32 ulp
        ulp = 2**-23 if name.endswith("global_scale") else 0
        torch.testing.assert_close(back[name].float(), original[name].float().reshape(back[name].shape), rtol=ulp,
                                   atol=0, msg=name)


def test_autoawq_to_compressed_tensors_keeps_zero_points(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    int4_checkpoint(tmp_path / "awq", "awq")
    convert(tmp_path / "awq", tmp_path / "ct", "compressed-tensors")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert checkpoint.read(tmp_path / "ct").layer_format("model.layers.0.mlp.up_proj") is formats.W4A16_ZP
    assert torch.equal(_logits(tmp_path / "awq"), _logits(tmp_path / "ct"))


def test_zero_points_to_modelopt_are_refused_with_one_line(tmp_path, capsys):
    int4_checkpoint(tmp_path / "awq", "awq")
    code = main(["convert", str(tmp_path / "awq"), str(tmp_path / "mo"), "--to", "modelopt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "W4A16_ZP" in err[-1] and "no modelopt quant_algo" in err[-1]
    assert not (tmp_path / "mo").exists() and not list(tmp_path.glob(".mo.tmp-*"))


def test_cli_writes_with_progress_and_refuses_an_existing_output(tmp_path, capsys):
    compressed_tensors_checkpoint(tmp_path / "src", "W4A16_ASYM")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ct"), "--to", "compressed-tensors"]) == 0
    err = capsys.readouterr().err
    assert "converting to compressed-tensors: 14/14 linears" in err and (tmp_path / "ct" / "tokenizer.json").exists()
    assert torch.equal(_logits(tmp_path / "src"), _logits(tmp_path / "ct"))
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ct"), "--to", "modelopt"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_int8_dynamic_per_token_round_trips_through_compressed_tensors(tmp_path):
    """llm-compressor's W8A8 preset (int8 channel weights, dynamic per-token int8 input) read and written back: the
    same tensors and scheme; modelopt has no such quant_algo, so --to modelopt is refused."""
    qc = compressed_tensors_checkpoint(tmp_path / "src", "W8A8")
    convert(tmp_path / "src", tmp_path / "ct", "compressed-tensors")
    back_qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    for part in ("weights", "input_activations"):
        theirs, ours = qc["config_groups"]["group_0"][part], back_qc["config_groups"]["group_0"][part]
        assert {k: ours[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == \
            {k: theirs[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")}, part
    assert back_qc["format"] == qc["format"] == "int-quantized"
    original, back = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "ct" / "model.safetensors")
    assert sorted(original) == sorted(back)
    for name in original:
        assert torch.equal(back[name].float(), original[name].float().reshape(back[name].shape)), name
    assert checkpoint.read(tmp_path / "ct").layer_format("model.layers.0.mlp.up_proj") is \
        formats.INT8_PER_CHANNEL_PER_TOKEN
    assert torch.equal(_logits(tmp_path / "src"), _logits(tmp_path / "ct"))
    with pytest.raises(UserError, match="INT8_PER_CHANNEL_PER_TOKEN, which has no modelopt quant_algo"):
        convert(tmp_path / "src", tmp_path / "mo", "modelopt")
