"""Every recipe on a 2-layer cut of the embedded model: calibrate (4 x 64 tokens) -> export -> read back.

What is proven, per recipe:
- tensor names, dtypes, shapes and quant config match FORMATS.md;
- the packed integer/e2m1/fp8 codes in the checkpoint are exactly modelopt's own quantization of the weight its
  quantizer saw (codes recovered from modelopt's fake-quant weight). The only exceptions allowed are rounding ties
  (the weight sits on a midpoint to 1e-5 relative, common here because the weights come from a 4-bit GGUF grid),
  where modelopt's fake quant (x * (max/amax)) and its export (x / (amax/max)) may round to the two neighbours;
- every layer of a KV-quantized recipe has fp32 k_scale/v_scale = calibrated amax / 448;
- lowbit's reference reader gives the same logits as modelopt's fake-quant model (EXACT_TOL, NOISE_RATIO).
"""
import pytest
import torch

from lowbit import formats

RECIPES = ("fp8", "fp8_dynamic", "nvfp4", "int4_awq", "int4_rtn", "int4_gptq", "w8a8_sq")
# Reader vs modelopt fake-quant logits on 64 held-out tokens. AWQ: max |diff| <= EXACT_TOL (same numbers up to
# float rounding). Quantized-activation and tie-affected formats: float32 noise (sdpa vs modelopt's attention) or
# tie flips move a few activation/weight codes by one step, so the bound is relative to the quantization error
# itself: rel-L2(reader, modelopt) <= NOISE_RATIO * rel-L2(float model, modelopt). NVFP4 quantizes activations to
# e2m1 per 16-block: it matched exactly until the packages of 2026-12-01 (transformers 5.24, modelopt 0.47, torch
# 2.13), with which activation code flips give max |diff| 0.40 at rel-L2 5.7e-4 (quantization: 4.5e-2).
EXACT_TOL = 1e-3
# int4_awq: its clip search leaves most group scales off their max, where a few codes sit on float ties (rel-L2
# 3.0e-5 against quantization's 3.3e-2, max |diff| 5e-3).
NOISE_RATIO = {"w8a8_sq": 0.1, "int4_rtn": 0.1, "int4_awq": 0.01, "nvfp4": 0.1, "fp8": 0.75, "fp8_dynamic": 0.75}
TIE_FRACTION = 0.01  # at most 1 % of a layer's weights may sit on a tie


@pytest.fixture(scope="module")
def float_model():
    from lowbit import models
    from lowbit.quantize.api import load_float_model

    torch.set_num_threads(1)
    model, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    return model, tok


@pytest.fixture(scope="module", params=RECIPES)
def exported(request, float_model, tmp_path_factory):
    import copy

    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    from lowbit.calibrate.data import builtin_texts, token_batches
    from lowbit.calibrate.loop import calibrate
    from lowbit.checkpoint.io import read
    from lowbit.quantize.api import with_calibration
    from lowbit.quantize.export import export
    from lowbit.recipe import load_recipe

    model, tok = copy.deepcopy(float_model[0]), float_model[1]
    recipe = with_calibration(load_recipe(request.param), num_samples=4, seq_len=64)
    calibrate(model, recipe, token_batches(tok, builtin_texts("boolq", "calib"), 4, 64))
    requantize_resmooth_fused_llm_layers(model)  # export's own first step: shares scales of fused q/k/v, gate/up
    ids = torch.tensor(token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64)[0])[None]
    with torch.no_grad():
        logits = model(ids).logits
        linears = {n: (m.weight.detach().clone(), m.weight_quantizer(m.weight).detach().clone())
                   for n, m in model.named_modules() if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled}
    kv_amax = {n: (m.k_bmm_quantizer.amax.clone(), m.v_bmm_quantizer.amax.clone())
               for n, m in model.named_modules() if hasattr(m, "k_bmm_quantizer") and m.k_bmm_quantizer.is_enabled}
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    export(model, tok, recipe, out, source="test")
    ckpt = read(out)
    return {"recipe": recipe, "ckpt": ckpt, "tensors": ckpt.tensors(), "ids": ids, "logits": logits,
            "linears": linears, "kv_amax": kv_amax}


def layer_tensors(tensors: dict, name: str) -> dict:
    return {k[len(name) + 1:]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}


EXPECTED = {  # quant_algo -> {tensor: (dtype, shape as a function of (out, in))}
    "FP8": {"weight": (torch.float8_e4m3fn, lambda o, i: (o, i)), "weight_scale": (torch.float32, lambda o, i: ()),
            "input_scale": (torch.float32, lambda o, i: ())},
    "FP8_PER_CHANNEL_PER_TOKEN": {"weight": (torch.float8_e4m3fn, lambda o, i: (o, i)),
                                  "weight_scale": (torch.float32, lambda o, i: (o,))},
    "NVFP4": {"weight": (torch.uint8, lambda o, i: (o, i // 2)),
              "weight_scale": (torch.float8_e4m3fn, lambda o, i: (o, i // 16)),
              "weight_scale_2": (torch.float32, lambda o, i: ()), "input_scale": (torch.float32, lambda o, i: ())},
    "W8A8_SQ_PER_CHANNEL": {"weight": (torch.int8, lambda o, i: (o, i)), "weight_scale": (torch.float32, lambda o, i: (o,)),
                            "input_scale": (torch.float32, lambda o, i: ()),
                            "pre_quant_scale": (torch.float32, lambda o, i: (i,))},
}


def expected_layout(algo: str, group: int | None, name: str) -> dict:
    if algo != "W4A16_AWQ":
        return EXPECTED[algo]
    layout = {"weight": (torch.uint8, lambda o, i: (o // 2, i)),
              "weight_scale": (torch.float32, lambda o, i: (o, i // group))}
    if name.endswith(("o_proj", "down_proj")):  # q/k/v and gate/up: folded into the preceding RMSNorm
        layout["pre_quant_scale"] = (torch.float32, lambda o, i: (i,))
    return layout


def test_layout_matches_formats_md(exported):
    ckpt, tensors, recipe = exported["ckpt"], exported["tensors"], exported["recipe"]
    if recipe.quant_algo == "W4A16_AWQ":
        assert ckpt.quant_algo == "MIXED_PRECISION"  # group 64 for 576-wide inputs, 128 for down_proj
    else:
        assert ckpt.quant_algo == recipe.quant_algo
    assert ckpt.kv_algo == recipe.kv_cache
    assert "lm_head.weight_scale" not in tensors and ckpt.layer_algo("lm_head") is None
    for name, (w, _) in exported["linears"].items():
        out_f, in_f = w.shape
        group = None
        if recipe.quant_algo == "W4A16_AWQ":
            entry = ckpt.quant["quantized_layers"][name]
            group = entry["group_size"]
            assert entry["quant_algo"] == "W4A16_AWQ" and group == (128 if in_f % 128 == 0 else 64)
        expected = expected_layout(recipe.quant_algo, group, name)
        got = {k: v for k, v in layer_tensors(tensors, name).items() if k not in ("k_scale", "v_scale")}
        if recipe.algorithm == "rtn":
            expected = {k: v for k, v in expected.items() if k != "pre_quant_scale"}
        assert set(got) == set(expected), name
        for key, (dtype, shape) in expected.items():
            assert got[key].dtype == dtype and tuple(got[key].shape) == shape(out_f, in_f), f"{name}.{key}"


def test_kv_scales_calibrated_for_every_layer(exported):
    recipe, tensors = exported["recipe"], exported["tensors"]
    if not recipe.kv_cache:
        assert not any(k.endswith(("k_scale", "v_scale")) for k in tensors)
        return
    assert len(exported["kv_amax"]) == 2
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        k_amax, v_amax = exported["kv_amax"][attn]
        k, v = tensors[f"{attn}.k_proj.k_scale"], tensors[f"{attn}.v_proj.v_scale"]
        assert k.dtype == v.dtype == torch.float32 and k.shape == v.shape == ()
        torch.testing.assert_close(k, k_amax.float().squeeze() / 448, rtol=1e-6, atol=0)
        torch.testing.assert_close(v, v_amax.float().squeeze() / 448, rtol=1e-6, atol=0)
        assert k != 1.0 and v != 1.0


def codes_and_grid(algo: str, t: dict, w: torch.Tensor):
    """(codes in the checkpoint, a function mapping float values -> the same kind of codes, step scale [out, in])."""
    if algo in ("NVFP4", "W4A16_NVFP4"):
        scale = (t["weight_scale"].float() * t["weight_scale_2"].float()).repeat_interleave(16, dim=1)
        return formats.unpack_e2m1(t["weight"]), lambda x: formats.e2m1_codes(x / scale), scale
    if algo == "W4A16_AWQ":
        s = t["weight_scale"].float()
        scale = s.repeat_interleave(w.shape[1] // s.shape[1], dim=1)
        # clamp: AWQ's clip search leaves group amax below the group's largest weight
        return formats.unpack_int4_rows(t["weight"]), lambda x: (x / scale).round().clamp(-8, 7).to(torch.int8), scale
    scale = t["weight_scale"].float().reshape(-1, 1).expand_as(w)
    if algo == "W8A8_SQ_PER_CHANNEL":
        return t["weight"], lambda x: (x / scale).round().clamp(-128, 127).to(torch.int8), scale
    return t["weight"].float(), lambda x: (x / scale).to(torch.float8_e4m3fn).float(), scale  # FP8 flavours


def decode(algo: str, codes: torch.Tensor) -> torch.Tensor:
    return formats.e2m1_decode(codes) if algo in ("NVFP4", "W4A16_NVFP4") else codes.float()


def test_packed_codes_equal_modelopt_quantization(exported):
    ckpt, tensors = exported["ckpt"], exported["tensors"]
    for name, (w, fake_quant_w) in exported["linears"].items():
        algo = ckpt.layer_algo(name)
        codes, to_codes, scale = codes_and_grid(algo, layer_tensors(tensors, name), w)
        assert torch.equal(to_codes(w), codes), f"{name}: checkpoint codes differ from export arithmetic"
        modelopt_codes = to_codes(fake_quant_w)  # exact: fake-quant values are code * scale (to 1 ulp)
        differ = decode(algo, modelopt_codes) != decode(algo, codes)  # by value: e2m1 -0 (code 8) equals +0
        x = w / scale  # the weight in code units
        a, b = decode(algo, codes)[differ], decode(algo, modelopt_codes)[differ]
        ties = ((x[differ] - a).abs() - (x[differ] - b).abs()).abs() <= 1e-5 * x[differ].abs()
        assert ties.all(), f"{name}: {int((~ties).sum())} codes differ from modelopt's away from a rounding tie"
        assert differ.float().mean() <= TIE_FRACTION, name


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_reader_logits_match_modelopt_fake_quant(exported, float_model):
    from lowbit.checkpoint.reference import load_reference_model

    model, _ = load_reference_model(exported["ckpt"].path)
    with torch.no_grad():
        logits = model(exported["ids"]).logits
        float_logits = float_model[0](exported["ids"]).logits
    ref, name = exported["logits"], exported["recipe"].name
    reader_gap, quant_gap = rel_l2(logits, ref), rel_l2(float_logits, ref)
    print(f"{name}: max |diff| {(logits - ref).abs().max().item():.2e}, rel-L2 reader {reader_gap:.2e} "
          f"vs quantization {quant_gap:.2e}")
    if name in NOISE_RATIO:
        assert reader_gap <= NOISE_RATIO[name] * quant_gap
    else:
        assert (logits - ref).abs().max().item() <= EXACT_TOL
