"""Group sizes for layers whose in_features the recipe's group size does not divide.

modelopt calibrates such layers with a padded last group but cannot export them ("partial blocks are not
supported"), and a group straddling two rows would be wrong. lowbit's rule: such a layer gets the largest group
size/2^k that divides its in_features (SmolLM2-135M, group 128: the 576-wide q/k/v/o and
gate/up projections get 64, the 1536-wide down_proj keeps 128). modelopt's export then records the truth per layer:
quant_algo MIXED_PRECISION with `quantized_layers: {name: {quant_algo: W4A16_AWQ, group_size: 64|128}}`, and the
scale shapes [out, in/group] agree with it.
"""
import fnmatch

from lowbit.errors import UserError

MIN_GROUP = 16


def layer_group(in_features: int, group: int) -> int:
    """The group size a layer with `in_features` inputs gets under a recipe group size `group`."""
    g = group
    while in_features % g:
        g //= 2
        if g < MIN_GROUP:
            raise UserError(f"no group size >= {MIN_GROUP} (the group size halved) divides in_features "
                            f"{in_features}; exclude the layer in the recipe or choose another group_size")
    return g


def group_overrides(model, group: int, exclude=()) -> dict:
    """{module name: group size} for the linears (not excluded) whose in_features `group` does not divide."""
    from torch import nn

    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _excluded(name, exclude):
            continue
        if module.in_features % group:
            out[name] = layer_group(module.in_features, group)
    return out


def _excluded(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, f"*{p}*") for p in patterns)
