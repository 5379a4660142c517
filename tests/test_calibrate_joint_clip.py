"""Joint clip refinement (calibrate/joint_clip.py) against the brute-force optimum of its objective, its descent, the
recipe keys that reach it and AWQ-lite's sample count, and the shipped int4_awq checkpoint: format and reader vs
modelopt's fake quant."""
import shutil

import pytest
import torch

from lowbit.calibrate.awq_clip import clip_ratios
from lowbit.calibrate.gptq import Hessians, quantized_linears
from lowbit.calibrate.joint_clip import refine_clips
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.errors import UserError
from lowbit.recipe import recipe_from_dict

from test_calibrate_awq_clip import GROUP, awq_recipe, batches, tiny_llama

torch.set_num_threads(1)
READER_REL = 1e-5  # reader vs modelopt fake quant, weight-only INT4 (as tests/test_calibrate_rotate.py)


def row_error(m, h) -> torch.Tensor:
    """e^T H e per output row, float64, e = fake-quantized weight - weight."""
    e = (m.weight_quantizer(m.weight) - m.weight).detach().double()
    return torch.einsum("oi,ij,oj->o", e, h.double(), e)


@pytest.fixture(scope="module")
def awq_full_model():
    data = batches()
    model = calibrate(tiny_llama(), awq_recipe(), data)
    layers = quantized_linears(model)
    hessians = Hessians(layers)
    forward_loop(data, desc="test")(model)
    hessians.remove()
    return model, hessians.h


def test_never_increases_any_rows_error_and_stays_on_the_grid(awq_full_model):
    model, hs = awq_full_model
    moved = 0
    for name, m in quantized_linears(model):
        before = row_error(m, hs[name])
        moved += refine_clips(m, hs[name], clip_ratios())
        after = row_error(m, hs[name])
        assert (after <= before * (1 + 1e-5) + 1e-12).all(), name
        group_max = m.weight.detach().reshape(-1, GROUP).abs().amax(-1, keepdim=True)
        ratio = m.weight_quantizer.amax.float() / group_max
        assert sum(torch.isclose(ratio, torch.tensor(r), rtol=1e-5) for r in clip_ratios()).all(), name
    assert moved > 0


def test_single_group_rows_get_the_least_error_ratio():
    """With one group per row there is nothing to coordinate: the result is the grid's argmin of e^T H e."""
    import modelopt.torch.quantization as mtq

    from test_calibrate_gptq import IN, OUT, problem

    w, x, h, _ = problem(seed=2)
    lin = torch.nn.Linear(IN, OUT, bias=False)
    lin.weight.data.copy_(w)
    cfg = {"quant_cfg": [{"quantizer_name": "*weight_quantizer",
                          "cfg": {"num_bits": 4, "block_sizes": {-1: IN, "type": "static"}}},
                         {"quantizer_name": "*input_quantizer", "enable": False}], "algorithm": "max"}
    mtq.quantize(lin, cfg, lambda m: m(x))
    group_max = lin.weight_quantizer.amax.clone()
    losses = []
    for r in clip_ratios():
        lin.weight_quantizer.amax = group_max * r
        losses.append(row_error(lin, h))
    lin.weight_quantizer.amax = group_max
    refine_clips(lin, h, clip_ratios())
    best = torch.stack(losses).min(0).values
    assert torch.allclose(row_error(lin, h), best, rtol=1e-6)
    assert (lin.weight_quantizer.amax < group_max).any()


def test_recipe_keys_reach_the_passes():
    """joint_clip moves clips, not in the linears joint_clip_skip names; awq_lite_samples gives AWQ-lite the first
    sequences only (the same scales as AWQ-lite run on those alone)."""
    data = batches()
    plain = calibrate(tiny_llama(), awq_recipe(), data)
    joint = calibrate(tiny_llama(), awq_recipe(algorithm_args={"alpha_step": 0.25, "joint_clip": True,
                                                               "joint_clip_skip": ["down_proj"]}), data)
    amax = {n: m.weight_quantizer.amax for n, m in quantized_linears(plain)}
    for name, m in quantized_linears(joint):
        if name.endswith("down_proj"):
            assert torch.equal(m.weight_quantizer.amax, amax[name]), name
    assert any(not torch.equal(m.weight_quantizer.amax, amax[n]) for n, m in quantized_linears(joint))

    def scales(model):
        return {n: m.input_quantizer.pre_quant_scale for n, m in quantized_linears(model)}

    lite = dict(algorithm="awq_lite")
    first = scales(calibrate(tiny_llama(), awq_recipe(**lite), data[:4]))
    limited = scales(calibrate(tiny_llama(), awq_recipe(**lite, algorithm_args={"alpha_step": 0.25,
                                                                                "awq_lite_samples": 4}), data))
    every = scales(calibrate(tiny_llama(), awq_recipe(**lite), data))
    assert all(torch.equal(first[n], limited[n]) for n in first)
    assert any(not torch.equal(first[n], every[n]) for n in first)


@pytest.mark.parametrize("args, other, message", [
    ({"joint_clip": "yes"}, {}, "algorithm_args.joint_clip"),
    ({"joint_clip_skip": "down_proj"}, {}, "algorithm_args.joint_clip_skip"),
    ({"joint_clip": True}, {"algorithm": "awq_lite"}, "algorithm_args.joint_clip"),
    ({"awq_lite_samples": 0}, {}, "algorithm_args.awq_lite_samples"),
    ({"awq_lite_samples": 2.5}, {}, "algorithm_args.awq_lite_samples"),
    ({"awq_lite_samples": 4}, {"algorithm": "rtn"}, "algorithm_args.awq_lite_samples"),
])
def test_bad_keys_fail_with_one_line_naming_the_key(args, other, message):
    """Types fail when the recipe is read, keys that do not apply to the algorithm when its config is made."""
    from lowbit.calibrate.configs import modelopt_config

    with pytest.raises(UserError, match=f"bad value for '{message}'") as e:
        modelopt_config(awq_recipe(algorithm_args=args, **other))
    assert "\n" not in str(e.value)


def test_shipped_int4_awq_checkpoint_format_and_reader(tmp_path):
    """The shipped recipe's passes (AWQ-lite on its first sequences, clip search, joint refinement) on a tiny model:
    the checkpoint says W4A16_AWQ with int4 group weights, and the reader's logits equal the fake quant's."""
    from lowbit.calibrate.data import builtin_texts, token_batches
    from lowbit.checkpoint import load_reference_model, read
    from lowbit.models import DEFAULT_MODEL, resolve
    from lowbit.quantize.api import load_float_model, with_calibration
    from lowbit.quantize.export import export
    from lowbit.recipe import load_recipe

    from test_calibrate_rotate import rel_l2, tiny

    src = tmp_path / "tiny"
    tiny("llama", tied=True).save_pretrained(src)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    shipped = load_recipe("int4_awq")
    recipe = with_calibration(shipped, num_samples=4, seq_len=64)
    args = {**recipe.algorithm_args, "awq_lite_samples": 2}
    assert args.get("joint_clip") is True
    recipe = recipe_from_dict({**recipe.to_dict(), "algorithm_args": args}, source="int4_awq")
    model, tok = load_float_model(src)
    heldout = torch.tensor(token_batches(tok, builtin_texts("boolq", "heldout"), 1, 64, seed=0))
    calibrate(model, recipe, token_batches(tok, builtin_texts("boolq", "calib"), 4, 64, seed=0))
    with torch.no_grad():
        fake_quant = model(heldout).logits
    out = tmp_path / "ckpt"
    export(model, tok, recipe, out, source="tiny")
    ckpt = read(out)
    assert ckpt.layer_algo("model.layers.1.mlp.down_proj") is not None and ckpt.layer_algo("lm_head") is None
    reader, _ = load_reference_model(out)
    with torch.no_grad():
        assert rel_l2(reader(heldout).logits, fake_quant) < READER_REL


def test_hessians_from_the_clip_search_pass_are_the_float_models():
    """H collected during the clip search's pass (float weights) equals H of a plain float forward, each input
    counted once although the search's own hook runs the input quantizer too."""
    from lowbit.calibrate.awq_clip import awq_clip_search
    from lowbit.calibrate.joint_clip import input_hessians
    from lowbit.calibrate.resmooth import share_pre_quant_scales

    data = batches()
    model = calibrate(tiny_llama(), awq_recipe(algorithm="awq_lite"), data)
    share_pre_quant_scales(model)
    layers = quantized_linears(model)
    for _, m in layers:
        m.weight_quantizer.disable()
    plain = Hessians(layers)
    forward_loop(data, desc="float")(model)
    plain.remove()
    for _, m in layers:
        m.weight_quantizer.enable()
    during = input_hessians(model, skip=("down_proj",))
    awq_clip_search(model, forward_loop(data, desc="clip"))
    during.remove()
    assert set(during.h) == {n for n, _ in layers if not n.endswith("down_proj")}
    for name, h in during.h.items():
        assert torch.allclose(h, plain.h[name], rtol=1e-5, atol=1e-6), name
