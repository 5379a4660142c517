"""lowbit's AWQ clip search (calibrate/awq_clip.py) against modelopt's own awq_clip on the same model and tokens, and
the order awq_full runs it in."""
import copy

import pytest
import torch

from lowbit.calibrate.awq_clip import clip_ratios
from lowbit.calibrate.gptq import quantized_linears
from lowbit.calibrate.loop import calibrate
from lowbit.recipe import recipe_from_dict

GROUP = 32


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(cfg).eval()


def awq_recipe(**over):
    return recipe_from_dict({"name": "awq_test", "quant_algo": "W4A16_AWQ", "algorithm": "awq_full",
                             "algorithm_args": {"alpha_step": 0.25}, "group_size": GROUP, "exclude": ["lm_head"],
                             **over})


def batches(n=8, length=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


def amaxes(model):
    return {name: m.weight_quantizer.amax.float().clone() for name, m in quantized_linears(model)}


@pytest.fixture(scope="module")
def both():
    """AWQ-lite and export's re-smoothing once, then the clip search by lowbit and by modelopt's awq_clip."""
    from modelopt.torch.quantization.model_calib import awq_clip

    from lowbit.calibrate.awq_clip import awq_clip_search
    from lowbit.calibrate.resmooth import share_pre_quant_scales
    from lowbit.calibrate.loop import forward_loop

    data = batches()
    model = calibrate(tiny_llama(), awq_recipe(algorithm="awq_lite"), data)
    share_pre_quant_scales(model)
    theirs = copy.deepcopy(model)
    awq_clip_search(model, forward_loop(data, desc="lowbit clip"))
    awq_clip(theirs, forward_loop(data, desc="modelopt clip"))
    return amaxes(model), amaxes(theirs)


def test_same_clip_as_modelopts_awq_clip(both):
    """Each group's amax is the one modelopt's clip search picks on the same model and tokens: identical in at least
    99 % of groups (the rest: ties between two ratios within float rounding, one grid step apart)."""
    ours, theirs = both
    assert ours.keys() == theirs.keys() and len(ours) == 14
    same = total = 0
    for name, amax in ours.items():
        assert amax.shape == theirs[name].shape, name
        same += int((amax == theirs[name]).sum())
        total += amax.numel()
        assert torch.allclose(amax, theirs[name], rtol=0.06), name  # 0.05: one step of the ratio grid
    assert same / total >= 0.99, f"{same}/{total} groups picked the same clip"


def test_awq_full_keeps_its_clips_through_exports_resmoothing():
    """awq_full = AWQ-lite, export's re-smoothing, clip search: the re-smoothing export runs again finds nothing to
    change, so the checkpoint holds the searched clips (modelopt's own order re-calibrates q/k/v and gate/up to
    their max and loses them), and some groups are clipped below their max."""
    from lowbit.calibrate.resmooth import share_pre_quant_scales

    model = calibrate(tiny_llama(), awq_recipe(), batches())
    before = amaxes(model)
    share_pre_quant_scales(model)
    after = amaxes(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    lin = model.model.layers[0].self_attn.q_proj
    group_max = lin.weight.detach().reshape(-1, GROUP).abs().amax(-1, keepdim=True)
    q_amax = after["model.layers.0.self_attn.q_proj"].reshape(-1, 1)
    assert (q_amax <= group_max * (1 + 1e-6)).all() and (q_amax < group_max * 0.99).any()


def test_chosen_clip_has_the_least_loss_on_the_grid():
    """The objective itself on one linear, computed the slow way (elementwise, float64): the amax chosen for each
    group is its max times the ratio with the least output error on the sampled tokens, and some groups clip."""
    from lowbit.calibrate.awq_clip import awq_clip_search
    from lowbit.calibrate.loop import forward_loop

    model, data = tiny_llama(seed=3), batches(4, 32, seed=4)
    calibrate(model, awq_recipe(algorithm="awq_lite"), data)
    lin = model.model.layers[1].mlp.down_proj
    seen = []
    hook = lin.register_forward_pre_hook(lambda m, a: seen.append(m.input_quantizer(a[0]).detach().clone()))
    awq_clip_search(model, forward_loop(data, desc="test"))
    hook.remove()
    assert len(seen) == 1  # 4 sequences: one forward call
    x = seen[0].reshape(-1, seen[0].shape[-1])
    x = x[0::max(1, x.shape[0] // 64)].double()
    wq, w = lin.weight_quantizer, lin.weight.detach()
    chosen = wq.amax.clone()
    out, inp = w.shape
    group_max = w.reshape(out, inp // GROUP, GROUP).abs().amax(-1).reshape(-1, 1)
    losses = []
    for r in clip_ratios():
        wq.amax = group_max * r
        err = (wq(w).double() - w.double()).reshape(out, inp // GROUP, GROUP)
        losses.append(torch.einsum("ogk,tgk->otg", err, x.reshape(-1, inp // GROUP, GROUP)).pow(2).mean(1))
    wq.amax = chosen
    best = torch.stack(losses).argmin(0).reshape(-1, 1)  # [out * groups, 1]
    expected = group_max * torch.tensor(clip_ratios(), dtype=group_max.dtype)[best]
    assert torch.isclose(chosen.float(), expected.float(), rtol=1e-6).float().mean() >= 0.99
    assert (chosen < group_max).any()


def test_recipe_clip_keys_reach_the_search():
    """algorithm_args min_clip_ratio / shrink_step go to the clip search (modelopt's AWQ-lite config refuses them):
    every group's amax is then one of the ratios 0.8, 0.9, 1 of its max."""
    model = calibrate(tiny_llama(), awq_recipe(algorithm_args={"alpha_step": 0.5, "min_clip_ratio": 0.8,
                                                               "shrink_step": 0.1}), batches(4, 32))
    lin = model.model.layers[1].self_attn.o_proj
    group_max = lin.weight.detach().reshape(-1, GROUP).abs().amax(-1, keepdim=True)
    ratio = lin.weight_quantizer.amax.float().reshape(-1, 1) / group_max
    on_grid = sum(torch.isclose(ratio, torch.tensor(r), rtol=1e-5) for r in (0.8, 0.9, 1.0))
    assert bool(on_grid.all()) and bool((ratio < 0.95).any())


@pytest.mark.parametrize("args, message", [({"shrink_step": 0}, "shrink_step"), ({"alpha_step": 0}, "alpha_step"),
                                           ({"min_clip_ratio": 1.5}, "min_clip_ratio"),
                                           ({"max_tokens_per_batch": 0}, "max_tokens_per_batch"),
                                           ({"max_tokens_per_batch": 6.5}, "max_tokens_per_batch")])
def test_bad_clip_keys_fail_with_one_line_naming_the_key(args, message):
    from lowbit.errors import UserError

    with pytest.raises(UserError, match=f"algorithm_args.{message}") as e:
        awq_recipe(algorithm_args=args)
    assert "\n" not in str(e.value)
