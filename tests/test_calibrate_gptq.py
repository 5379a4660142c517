"""GPTQ rounding (calibrate/gptq.py) against modelopt's own GPTQ update, its effect on a layer's output error, and
the recipe keys that ask for it."""
import copy

import pytest
import torch
from torch import nn

from lowbit.calibrate.gptq import gptq_round, gptq_weight, quantized_linears, round_to_grid
from lowbit.errors import UserError
from lowbit.recipe import load_recipe, recipe_from_dict

OUT, IN, GROUP = 48, 96, 16


def problem(seed=0):
    """A weight [OUT, IN], correlated inputs [512, IN] (GPTQ only helps when inputs correlate), H = 2 X^T X / n."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(OUT, IN, generator=g)
    x = torch.randn(512, IN, generator=g) @ torch.randn(IN, IN, generator=g) * 0.3 + torch.randn(IN, generator=g)
    scale = w.reshape(OUT, IN // GROUP, GROUP).abs().amax(-1) / 7
    return w, x, 2 * x.t() @ x / x.shape[0], scale


def rtn(w, scale):
    return torch.stack([round_to_grid(w[:, j], scale[:, j // GROUP]) for j in range(w.shape[1])], 1)


def test_equals_modelopts_gptq_update_with_the_same_scales():
    from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse, gptq_blockwise_update

    w, _, h, scale = problem()
    ref = w.clone()
    gptq_blockwise_update(ref, compute_hessian_inverse(h, w, 0.01), 32, lambda m: rtn(m, scale))
    q, q_scale = gptq_weight(w, h, scale, GROUP, damp=0.01, block=32, static_groups=True)
    assert torch.allclose(q, ref, atol=1e-5) and torch.equal(q_scale, scale)


@pytest.mark.parametrize("static_groups", [True, False])
def test_rounds_onto_the_grid_and_halves_the_output_error_of_rtn(static_groups):
    w, x, h, scale = problem(1)
    scale = scale * 0.9  # a clip ratio, as AWQ's clip search leaves it
    q, q_scale = gptq_weight(w, h, scale, GROUP, static_groups=static_groups)
    assert torch.allclose(rtn(q, q_scale), q, atol=1e-6)  # every value already a code x its group's scale
    err = lambda v: ((x @ (v - w).t()) ** 2).mean().item()  # noqa: E731
    assert err(q) < 0.6 * err(rtn(w, scale)), (err(q), err(rtn(w, scale)))
    if not static_groups:  # the first group's scale is set before any error reaches it: the calibrated one
        assert torch.allclose(q_scale[:, 0], scale[:, 0]) and not torch.allclose(q_scale, scale)


def test_gptq_round_leaves_weights_on_modelopts_grid():
    import modelopt.torch.quantization as mtq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, 32))
    cfg = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    cfg["quant_cfg"] = [e if e.get("quantizer_name") != "*weight_quantizer" else
                        {**e, "cfg": {**e["cfg"], "block_sizes": {-1: GROUP, "type": "static"}}}
                        for e in cfg["quant_cfg"]]
    x = torch.randn(16, 8, IN) @ torch.randn(IN, IN) * 0.3
    mtq.quantize(model, cfg, lambda m: m(x))
    before = {n: m.weight_quantizer(m.weight).detach().clone() for n, m in quantized_linears(model)}
    gptq_round(model, lambda m: m(x))
    for name, m in quantized_linears(model):
        assert torch.allclose(m.weight_quantizer(m.weight), m.weight, atol=1e-6)
        assert not torch.equal(m.weight.detach(), before[name])  # rounding moved some codes


def with_changes(name, **changes):
    return recipe_from_dict({**load_recipe(name).to_dict(), **changes}, source="my.yaml")


@pytest.mark.parametrize("changes, key", [
    ({"rounding": "stochastic"}, "rounding"),
    ({"algorithm": "awq_magic"}, "algorithm"),
    ({"algorithm_args": {"alpha_step": 1.5}}, "algorithm_args.alpha_step"),
    ({"algorithm": "smoothquant", "algorithm_args": {"alpha": -0.1}}, "algorithm_args.alpha"),
    ({"algorithm": "awq_clip", "algorithm_args": {"min_clip_ratio": "half"}}, "algorithm_args.min_clip_ratio"),
    ({"rounding": "gptq", "rounding_args": {"damp": 0}}, "rounding_args.damp"),
    ({"rounding": "gptq", "rounding_args": {"blocks": 64}}, "rounding_args"),
    ({"rounding": "gptq", "rounding_args": {"static_groups": "yes"}}, "rounding_args.static_groups"),
])
def test_bad_recipe_values_fail_with_one_line_naming_key_and_file(changes, key):
    with pytest.raises(UserError, match=rf"my\.yaml: bad value for '{key}'") as e:
        with_changes("int4_awq", **changes)
    assert "\n" not in str(e.value)


def test_gptq_on_a_format_without_int4_groups_is_refused_by_name():
    from lowbit.calibrate.configs import modelopt_config

    with pytest.raises(UserError, match=r"my\.yaml: bad value for 'rounding': 'gptq' does not apply to FP8") as e:
        modelopt_config(with_changes("fp8", rounding="gptq"))
    assert "\n" not in str(e.value)
