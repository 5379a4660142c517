"""fp8_dynamic (FP8 per-channel weights, per-token activations) calibration and export of a tiny Qwen3-MoE whose
calibration routes no token to one expert: every expert linear exported per expert with one finite, positive weight
scale per output channel (the unrouted expert's from its own weight: modelopt's max calibration), no input scales;
lowbit's reader against modelopt's fake-quant model; the engine against the reader."""
import pytest
import torch
from safetensors import safe_open

from test_quantize_moe import EXPERTS, PARTS, UNROUTED
from test_quantize_moe_int4 import calibrate_and_export, check_reader
from test_serve_engine import check_against_reference

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return calibrate_and_export(tmp_path_factory, "fp8_dynamic")


def test_every_expert_exported_per_channel(exported):
    out, src, _, _ = exported
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(src / "model.safetensors", "pt") as source:
        names = set(f.keys())
        for layer in range(2):
            base = f"model.layers.{layer}.mlp.experts"
            for e in range(EXPERTS):
                for part in PARTS:
                    s = f.get_tensor(f"{base}.{e}.{part}.weight_scale")
                    assert f.get_tensor(f"{base}.{e}.{part}.weight").dtype == torch.float8_e4m3fn
                    assert s.numel() == 128 and bool(torch.isfinite(s).all() and (s > 0).all()), (layer, e, part)
                    assert f"{base}.{e}.{part}.input_scale" not in names
            for part in PARTS:  # the unrouted expert: its weight's own amax / 448 per output channel
                amax = source.get_tensor(f"{base}.{UNROUTED}.{part}.weight").abs().amax(1)
                scale = f.get_tensor(f"{base}.{UNROUTED}.{part}.weight_scale").reshape(-1)
                assert torch.allclose(scale, amax / 448, rtol=1e-5)


def test_reader_matches_modelopt_fake_quant(exported):
    check_reader(exported)


def test_engine_matches_reader(exported):
    llm = check_against_reference(exported[0], max_num_tokens=16)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.fp8.a13_scale is None
