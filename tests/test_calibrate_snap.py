"""FP8 weight snapping (calibrate/snap.py): on the embedded model, whose GGUF-derived weights sit on e4m3 rounding
ties, every exported FP8 weight code equals modelopt's fake-quant value, and the fake-quant model is unchanged."""
import torch
from safetensors import safe_open

from lowbit.calibrate.data import load_texts, token_batches
from lowbit.calibrate.snap import snap_fp8_weights
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export
from lowbit.recipe import load_recipe


def test_exported_fp8_codes_equal_fake_quant(embedded_model_dir, tmp_path):
    import modelopt.torch.quantization as mtq

    from lowbit.calibrate.configs import modelopt_config
    from lowbit.calibrate.loop import forward_loop

    recipe = with_calibration(load_recipe("fp8"), num_samples=1, seq_len=64)
    model, tok = load_float_model(embedded_model_dir)
    batches = token_batches(tok, load_texts(recipe.calibration.data), 1, 64, seed=0)
    model = mtq.quantize(model, modelopt_config(recipe, model), forward_loop(batches))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with torch.no_grad():
        fake = {n: m.weight_quantizer(m.weight).clone() for n, m in linears.items()}
        scale = {n: (m.weight_quantizer.amax / 448).clone() for n, m in linears.items()}
        unsnapped = sum(off(((m.weight / scale[n]).to(torch.float8_e4m3fn).float() * scale[n]), fake[n])
                        for n, m in linears.items())
        ids = torch.tensor(batches)
        before = model(ids).logits
        assert snap_fp8_weights(model) == len(linears)
        after = model(ids).logits
    assert torch.equal(before, after)  # snapping is idempotent under the fake quant
    out = tmp_path / "ckpt"
    export(model, tok, recipe, out, source="smollm2-135m")
    differ = 0
    with safe_open(out / "model.safetensors", "pt") as f:
        for n in linears:
            w = f.get_tensor(f"{n}.weight").float() * f.get_tensor(f"{n}.weight_scale")
            differ += off(w, fake[n])
    print(f"weights one e4m3 code off the fake quant: {unsnapped} unsnapped, {differ} snapped")
    assert unsnapped > 0  # the model does have ties: without snapping the export differs from the fake quant
    assert differ == 0


def off(w, ref) -> int:
    """Weights more than float rounding apart (one e4m3 code is >= 6 % of the value; ulps are 1e-7)."""
    return int(((w - ref).abs() > 1e-5 * ref.abs()).sum())
