"""lowbit's AWQ clip search (calibrate/awq_clip.py) against modelopt's own awq_full on the same model and tokens."""
import copy

import pytest
import torch

from lowbit.calibrate.awq_clip import clip_ratios
from lowbit.calibrate.configs import modelopt_config
from lowbit.calibrate.gptq import quantized_linears
from lowbit.calibrate.loop import calibrate
from lowbit.recipe import recipe_from_dict

GROUP = 32


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def awq_recipe(**over):
    return recipe_from_dict({"name": "awq_test", "quant_algo": "W4A16_AWQ", "algorithm": "awq_full",
                             "algorithm_args": {"alpha_step": 0.25}, "group_size": GROUP, "exclude": ["lm_head"],
                             **over})


def batches(n=8, length=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


def amaxes(model):
    return {name: (m.weight_quantizer.amax.float().clone(), m.input_quantizer.pre_quant_scale.clone())
            for name, m in quantized_linears(model)}


@pytest.fixture(scope="module")
def both():
    model, recipe, data = tiny_llama(), awq_recipe(), batches()
    theirs = calibrate(copy.deepcopy(model), recipe, data, config=modelopt_config(recipe, model))
    ours = calibrate(model, recipe, data)
    return amaxes(ours), amaxes(theirs)


def test_same_clip_as_modelopts_awq_full(both):
    """Same AWQ scales (modelopt's awq_lite ran in both), and each group's amax is the one modelopt's clip search
    picks: identical in at least 99 % of groups (the rest: ties between ratios within float rounding, whose
    amax then differs by one grid step)."""
    ours, theirs = both
    assert ours.keys() == theirs.keys() and len(ours) == 14
    same = total = 0
    for name, (amax, pqs) in ours.items():
        ref_amax, ref_pqs = theirs[name]
        assert torch.equal(pqs, ref_pqs), name
        assert amax.shape == ref_amax.shape, name
        same += int((amax == ref_amax).sum())
        total += amax.numel()
        assert torch.allclose(amax, ref_amax, rtol=0.06), name  # 0.05: one step of the ratio grid
    assert same / total >= 0.99, f"{same}/{total} groups picked the same clip"


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
