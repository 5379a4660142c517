"""compressed-tensors checkpoints written by the compressed-tensors library on a tiny Llama, read by lowbit: the
dequantized weights equal the library's own decompression, the engine's greedy tokens equal transformers' on the
decompressed weights (weight-only schemes) or lowbit's reference reader, and bad input fails with one line."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit import checkpoint, formats
from lowbit.errors import UserError
from interop_fixtures import LINEARS, SMALL, add_ct_kv_scales, compressed_tensors_checkpoint, ct_decompress

pytest.importorskip("compressed_tensors")

SCHEMES = {"W4A16": formats.W4A16_AWQ, "W4A16_ASYM": formats.W4A16_ZP, "FP8": formats.FP8,
           "FP8_DYNAMIC": formats.FP8_PER_CHANNEL_PER_TOKEN, "NVFP4": formats.NVFP4, "NVFP4A16": formats.W4A16_NVFP4,
           "W8A8_STATIC": formats.W8A8_SQ_PER_CHANNEL, "W8A8": formats.INT8_PER_CHANNEL_PER_TOKEN}
PROMPTS = [[(7 * i + 3) % 1000 + 5 for i in range(n)] for n in (3, 17)]


def modules():
    return [f"model.layers.{i}.{m}" for i in range(SMALL["num_hidden_layers"]) for m in LINEARS]


def lowbit_tensors(ckpt, module: str) -> dict:
    tensors = ckpt.tensors()
    return {k[len(module) + 1:]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}


@pytest.mark.parametrize("preset", sorted(SCHEMES))
def test_dequantized_weights_equal_the_library_decompression(preset, tmp_path):
    qc = compressed_tensors_checkpoint(tmp_path, preset)
    ckpt = checkpoint.read(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    converted = ckpt.tensors()
    assert ckpt.layer_format("lm_head") is None and ckpt.quant["source"]["quant_algos"] == [SCHEMES[preset].name]
    for module in modules():
        fmt = ckpt.layer_format(module)
        assert fmt is SCHEMES[preset], module
        ours = fmt.dequantize({k[len(module) + 1:]: v for k, v in converted.items() if k.rsplit(".", 1)[0] == module})
        theirs = ct_decompress(qc, on_disk, module)
        if fmt.kernel == "nvfp4":
            # the library returns bf16(e2m1 * (scale / global)); ours is fp32 e2m1 * (scale * (1 / global)): equal
            # after the same rounding to bf16, but for products within an fp32 ulp of a bf16 rounding boundary
            assert theirs.dtype == torch.bfloat16
            assert (ours.bfloat16() != theirs).float().mean() < 1e-3, module
            torch.testing.assert_close(ours, theirs.float(), rtol=2**-8, atol=0)
        else:
            assert theirs.dtype == torch.float32 and torch.equal(ours, theirs), module


def _hf_greedy(model, prompts):
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def _engine_greedy(path, prompts):
    from lowbit.serve import LLM, SamplingParams

    llm = LLM(str(path), num_kv_blocks=32, max_num_tokens=48)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "NVFP4A16"])
def test_engine_greedy_equals_transformers_on_the_decompressed_model(preset, tmp_path):
    from interop_fixtures import tiny_llama

    qc = compressed_tensors_checkpoint(tmp_path, preset)
    on_disk = load_file(tmp_path / "model.safetensors")
    model = tiny_llama()  # same seed: the float weights the checkpoint came from; quantized ones replaced below
    state = model.state_dict()
    for module in modules():
        state[f"{module}.weight"] = ct_decompress(qc, on_disk, module).float()
    model.load_state_dict(state)
    assert _engine_greedy(tmp_path, PROMPTS) == _hf_greedy(model, PROMPTS)


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC", "W8A8"])
def test_engine_greedy_equals_the_reference_reader(preset, tmp_path):
    """Activation-quantized schemes: transformers cannot run them, lowbit's reference reader does (fake quant)."""
    compressed_tensors_checkpoint(tmp_path, preset)
    add_ct_kv_scales(tmp_path)
    model, _ = checkpoint.load_reference_model(tmp_path)
    assert _engine_greedy(tmp_path, PROMPTS) == _hf_greedy(model, PROMPTS)


def test_kv_cache_scheme_and_ignore_patterns(tmp_path):
    compressed_tensors_checkpoint(tmp_path, "W4A16", ignore=("lm_head", "re:.*mlp.down_proj"))
    add_ct_kv_scales(tmp_path, 0.02, 0.03)
    ckpt = checkpoint.read(tmp_path)
    assert ckpt.kv_format is formats.KV_FP8
    assert ckpt.layer_format("model.layers.1.mlp.down_proj") is None
    assert ckpt.layer_format("model.layers.1.mlp.up_proj") is formats.W4A16_AWQ
    tensors = ckpt.tensors()
    assert tensors["model.layers.1.self_attn.k_proj.k_scale"].item() == pytest.approx(0.02)
    assert tensors["model.layers.0.self_attn.v_proj.v_scale"].item() == pytest.approx(0.03)
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32


def _edit(path, drop=(), replace=None, config=None):
    tensors = load_file(path / "model.safetensors")
    for k in drop:
        del tensors[k]
    tensors.update(replace or {})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg["quantization_config"])
        (path / "config.json").write_text(json.dumps(cfg))


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("preset, edit, message", [
    ("W4A16", dict(drop=[f"{Q}.weight_scale"]), f"tensor {Q}.weight_scale is missing"),
    ("FP8_DYNAMIC", dict(drop=[f"{Q}.weight_scale"]), f"tensor {Q}.weight_scale is missing"),
    ("W4A16", dict(replace={f"{Q}.weight_packed": torch.zeros(64, 4, dtype=torch.int32)}),
     f"tensor {Q}.weight_packed has shape \\(64, 4\\), expected \\(64, 8\\)"),
    ("W4A16_ASYM", dict(replace={f"{Q}.weight_zero_point": torch.zeros(8, 3, dtype=torch.int32)}),
     f"tensor {Q}.weight_zero_point has shape"),
    ("FP8", dict(config=lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=6)),
     "scheme group_0 .*has no lowbit format"),
    ("W4A16", dict(config=lambda qc: qc.update(ignore=["lm_head", "re:.*q_proj"])), f"{Q} has quantization tensors"),
])
def test_bad_input_fails_at_load_naming_the_tensor(preset, edit, message, tmp_path):
    compressed_tensors_checkpoint(tmp_path, preset)
    _edit(tmp_path, **edit)
    with pytest.raises(UserError, match=message) as err:
        checkpoint.read(tmp_path).tensors()
    assert "\n" not in str(err.value)


def test_unsupported_scheme_is_refused_at_read(tmp_path):
    compressed_tensors_checkpoint(tmp_path, "W4A8")  # int4 weights, dynamic per-token int8 input: no lowbit format
    with pytest.raises(UserError, match="weights .*'num_bits': 4.*'dynamic': True.* has no lowbit format"):
        checkpoint.read(tmp_path)
