"""NVFP4 weight block-scale search (calibrate/nvfp4_clip.py): never worse than the plain max scale on the error it
minimises, applied through clamping so that modelopt's own dynamic block scales (fake quant and export) are the
chosen ones, and the checkpoint keeps NVFP4's layout with the reader matching the fake-quant model."""
import shutil

import pytest
import torch

from lowbit.calibrate.nvfp4_clip import block_errors, round_e2m1_fast, search_clamp
from lowbit.calibrate.nvfp4_cpu import nvfp4_fake_quant, round_e2m1
from lowbit.errors import UserError
from lowbit.recipe import load_recipe, recipe_from_dict

torch.set_num_threads(1)


def random_weight(seed: int, out: int = 48, inp: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g)  # rows of different scale
    w[5, 7] = 12.0  # one outlier holds the tensor's amax
    return w


def block_loss(q, w, col_weight):
    return ((q - w).pow(2) * col_weight).reshape(w.shape[0], -1, 16).sum(-1)


def test_fast_e2m1_rounding_equals_the_kernels_ties_included():
    mag = torch.cat([torch.arange(0, 10, 1 / 1024), torch.rand(10000) * 8, torch.tensor([float("inf")])])
    assert torch.equal(round_e2m1_fast(mag), round_e2m1(mag))  # the grid holds every midpoint (0.25, 0.75, ... 5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_search_never_increases_the_block_error_and_keeps_the_tensor_amax(seed, weighted):
    w = random_weight(seed)
    col = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed)) * 10 if weighted else None
    amax = w.abs().amax()
    clamped = search_clamp(w, amax, col)
    cw = col if weighted else torch.ones(w.shape[1])
    plain, searched = nvfp4_fake_quant(w, amax), nvfp4_fake_quant(clamped, amax)  # modelopt's dynamic block math
    before, after = block_loss(plain, w, cw), block_loss(searched, w, cw)
    assert (after <= before * (1 + 1e-6)).all()
    assert after.sum() < 0.95 * before.sum()  # most blocks of Gaussian weights gain from a smaller scale
    assert clamped.abs().amax() == amax  # weight_scale_2 unchanged
    # the fake quant of the clamped weight is the search's best candidate in every block but the amax block
    _, losses = block_errors(w, amax / (6 * 448), col)
    free = torch.ones_like(after, dtype=torch.bool)
    free[5, 0] = False
    torch.testing.assert_close(after[free], losses.min(0).values[free], rtol=1e-5, atol=1e-7)


def test_blocks_below_the_smallest_scale_are_left_alone():
    w = random_weight(3)
    w[0] = 1e-9  # a row far below the tensor's grid: every candidate underflows
    clamped = search_clamp(w, w.abs().amax())
    assert torch.equal(clamped[0], w[0])


SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.05, tie_word_embeddings=False, max_position_embeddings=256)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lowbit.calibrate.data import builtin_texts, token_batches
    from lowbit.calibrate.loop import calibrate
    from lowbit.checkpoint import load_reference_model, read
    from lowbit.models import DEFAULT_MODEL, resolve
    from lowbit.quantize.api import load_float_model, with_calibration
    from lowbit.quantize.export import export

    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), dtype=torch.float32).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    recipe = with_calibration(with_changes("nvfp4", weight_scale_search="output"), num_samples=4, seq_len=64)
    model, tok = load_float_model(src)
    float_model, _ = load_float_model(src)
    heldout = torch.tensor(token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0))
    calibrate(model, recipe, token_batches(tok, builtin_texts("boolq", "calib"), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant = model(heldout).logits
        float_logits = float_model(heldout).logits
        linears = {n: (m.weight.detach().clone(), m.weight_quantizer.amax.clone(), dict(float_model.named_modules())[n].weight.detach())
                   for n, m in model.named_modules() if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled}
    out = tmp_path_factory.mktemp("ckpt") / "nvfp4"
    export(model, tok, recipe, out, source="test")
    reader, _ = load_reference_model(out)
    with torch.no_grad():
        reader_logits = reader(heldout).logits
    return {"ckpt": read(out), "linears": linears, "fake_quant": fake_quant, "float": float_logits,
            "reader": reader_logits}


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_checkpoint_keeps_nvfp4_layout_and_weight_scale_2(run):
    ckpt, tensors = run["ckpt"], run["ckpt"].tensors()
    assert ckpt.quant_algo == "NVFP4" and ckpt.kv_algo == "FP8"
    clipped = 0
    for name, (w, amax, w_float) in run["linears"].items():
        o, i = w.shape
        assert tensors[f"{name}.weight"].dtype == torch.uint8 and tuple(tensors[f"{name}.weight"].shape) == (o, i // 2)
        scale = tensors[f"{name}.weight_scale"]
        assert scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (o, i // 16)
        torch.testing.assert_close(tensors[f"{name}.weight_scale_2"], amax.float().squeeze() / (6 * 448))
        plain = (w_float.abs().reshape(o, -1, 16).amax(-1) / (6 * amax / (6 * 448))).to(torch.float8_e4m3fn)
        clipped += int((scale.float() < plain.float()).sum())
    assert clipped > 0


def test_reader_matches_fake_quant(run):
    # NVFP4 activation code flips between the reader and modelopt (test_formats_export.py): bound relative to the
    # quantization error itself
    assert rel_l2(run["reader"], run["fake_quant"]) <= 0.1 * rel_l2(run["float"], run["fake_quant"])


def with_changes(name, **changes):
    return recipe_from_dict({**load_recipe(name).to_dict(), **changes}, source="my.yaml")


@pytest.mark.parametrize("name, value, message", [
    ("nvfp4", "gptq", r"'gptq' is not one of mse, output or null"),
    ("nvfp4", True, r"True is not one of mse, output or null"),
    ("int4_rtn", "mse", r"applies to NVFP4 weights only, not W4A16_AWQ"),
])
def test_bad_weight_scale_search_fails_with_one_line(name, value, message):
    with pytest.raises(UserError, match=rf"my\.yaml: bad value for 'weight_scale_search': {message}") as e:
        with_changes(name, weight_scale_search=value)
    assert "\n" not in str(e.value)
