"""AutoAWQ GEMM and GPTQ checkpoints on a tiny Llama, packed by those libraries' conventions (their writers need
CUDA builds; tests/interop_fixtures.py packs independently of lowbit's readers): lowbit's dequantized weights equal
(q - z[g_idx]) * s[g_idx] exactly, the engine's greedy tokens equal transformers' on those float weights, and bad
input fails with one line naming the tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit import checkpoint, formats
from lowbit.errors import UserError
from interop_fixtures import int4_checkpoint

PROMPTS = [[(7 * i + 3) % 1000 + 5 for i in range(n)] for n in (3, 17)]
CASES = {  # name: (method, sym, act_order, lowbit format of every linear; None: dequantized to float at load)
    "awq": ("awq", False, False, formats.W4A16_ZP),
    "gptq-sym": ("gptq", True, False, formats.W4A16_AWQ),
    "gptq-asym": ("gptq", False, False, formats.W4A16_ZP),
    "gptq-act-order": ("gptq", True, True, None),
}


def _weights(ckpt, module: str) -> torch.Tensor:
    tensors = ckpt.tensors()
    local = {k[len(module) + 1:]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
    fmt = ckpt.layer_format(module)
    return local["weight"] if fmt is None else fmt.dequantize(local)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dequantized_weights_equal_the_reference_formula(case, tmp_path):
    method, sym, act_order, fmt = CASES[case]
    reference, _ = int4_checkpoint(tmp_path, method, sym=sym, act_order=act_order)
    ckpt = checkpoint.read(tmp_path)
    for module, w in reference.items():
        assert ckpt.layer_format(module) is fmt, module
        ours = _weights(ckpt, module)
        assert ours.dtype == torch.float32 and torch.equal(ours, w), module


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_equals_transformers(case, tmp_path):
    from lowbit.serve import LLM, SamplingParams

    method, sym, act_order, _ = CASES[case]
    _, model = int4_checkpoint(tmp_path, method, sym=sym, act_order=act_order)
    expected = []
    for ids in PROMPTS:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        expected.append(gen[0, len(ids):].tolist())
    llm = LLM(str(tmp_path), num_kv_blocks=32, max_num_tokens=48)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


Q = "model.layers.0.self_attn.q_proj"


def _edit(path, drop=(), replace=None, config=None):
    tensors = load_file(path / "model.safetensors")
    for k in drop:
        del tensors[k]
    tensors.update(replace or {})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method, edit, message", [
    ("awq", dict(drop=[f"{Q}.scales"]), f"tensor {Q}.scales is missing"),
    ("awq", dict(replace={f"{Q}.qzeros": torch.zeros(3, 8, dtype=torch.int32)}), f"tensor {Q}.qzeros has shape"),
    ("awq", dict(config={"version": "gemv"}), "AutoAWQ version 'gemv'"),
    ("gptq", dict(replace={f"{Q}.g_idx": torch.full((64,), 5, dtype=torch.int32)}),
     f"tensor {Q}.g_idx holds groups in \\[5, 5\\], outside \\[0, 2\\)"),
    ("gptq", dict(replace={f"{Q}.scales": torch.ones(2, 60, dtype=torch.float16)}), f"tensor {Q}.scales has shape"),
    ("gptq", dict(config={"sym": True}), "tensor .*qzeros holds zero points other than 8"),
    ("gptq", dict(config={"bits": 3}), "GPTQ with 3 bits"),
])
def test_bad_input_fails_at_load_naming_the_tensor(method, edit, message, tmp_path):
    int4_checkpoint(tmp_path, method)
    _edit(tmp_path, **edit)
    with pytest.raises(UserError, match=message) as err:
        checkpoint.read(tmp_path).tensors()
    assert "\n" not in str(err.value)


def test_lowbit_models_shows_the_source_and_lowbit_formats(tmp_path):
    from lowbit.models import describe

    int4_checkpoint(tmp_path / "gptq", "gptq", sym=True)
    int4_checkpoint(tmp_path / "awq", "awq")
    assert describe(tmp_path / "gptq")["quantization"] == "gptq: W4A16_AWQ"
    assert describe(tmp_path / "awq")["quantization"] == "awq: W4A16_ZP"
    _edit(tmp_path / "awq", config={"version": "marlin"})
    assert describe(tmp_path / "awq")["quantization"].startswith("unreadable: ")
