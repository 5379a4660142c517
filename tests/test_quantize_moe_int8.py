"""w8a8_sq (INT8 SmoothQuant) calibration and export of a tiny Qwen3-MoE whose calibration routes no token to one
expert: every expert linear exported per expert as int8 with a finite, positive scale per output channel and a static
input scale; lowbit's reader against modelopt's fake-quant model; the engine against the reader.

How the experts are calibrated (modelopt 0.47 on transformers' fused experts): SmoothQuant's smoothing does not reach
them (it smooths 0 of their modules: no pre_quant_scale is exported, lowbit serves them with ones), each weight's
scale is its own channel amax / 127 (weight-only, so an unrouted expert is like any other), and the input quantizer
is one per projection shared by every expert: each expert's input_scale is the projection's amax over all routed
tokens / 127, the unrouted expert's included."""
import pytest
import torch
from safetensors import safe_open

from lowbit.checkpoint import read
from test_quantize_moe import EXPERTS, PARTS, UNROUTED
from test_quantize_moe_int4 import calibrate_and_export, check_reader
from test_serve_engine import check_against_reference

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return calibrate_and_export(tmp_path_factory, "w8a8_sq")


def test_every_expert_exported_as_int8_with_valid_scales(exported):
    out, src, _, _ = exported
    ckpt = read(out)
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(src / "model.safetensors", "pt") as source:
        names = set(f.keys())
        for layer in range(2):
            base = f"model.layers.{layer}.mlp.experts"
            assert ckpt.layer_algo(f"model.layers.{layer}.mlp.gate") is None
            for part in PARTS:
                x_scales = []
                for e in range(EXPERTS):
                    w, s = f.get_tensor(f"{base}.{e}.{part}.weight"), f.get_tensor(f"{base}.{e}.{part}.weight_scale")
                    assert w.dtype == torch.int8 and tuple(w.shape) == (128, 128) and s.numel() == 128
                    assert bool(torch.isfinite(s).all() and (s > 0).all()), (layer, e, part)
                    assert ckpt.layer_algo(f"{base}.{e}.{part}") == "W8A8_SQ_PER_CHANNEL"
                    assert f"{base}.{e}.{part}.pre_quant_scale" not in names
                    x_scales.append(f.get_tensor(f"{base}.{e}.{part}.input_scale").reshape(()))
                x_scales = torch.stack(x_scales)
                assert bool(torch.isfinite(x_scales).all() and (x_scales > 0).all())
                assert bool((x_scales == x_scales[0]).all())  # one input quantizer per projection
                amax = source.get_tensor(f"{base}.{UNROUTED}.{part}.weight").abs().amax(1)
                scale = f.get_tensor(f"{base}.{UNROUTED}.{part}.weight_scale").reshape(-1)
                assert torch.allclose(scale, amax / 127, rtol=1e-5)


def test_reader_matches_modelopt_fake_quant(exported):
    check_reader(exported)


def test_engine_matches_reader(exported):
    llm = check_against_reference(exported[0], max_num_tokens=16)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.int8 and bool((experts.int8.w13_smooth == 1).all())
