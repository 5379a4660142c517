"""Recipe -> nvidia-modelopt quantization config (a plain dict that mtq.quantize takes).

Each quant_algo starts from modelopt's stock config for that format; the recipe then sets the calibration
algorithm and its arguments, the weight group size, the exclusions and the KV-cache quantizers.
"""
import copy

from lowbit.calibrate.groups import group_overrides
from lowbit.errors import UserError
from lowbit.recipe import Recipe

STOCK = {  # quant_algo -> name of modelopt's stock config for that format
    "FP8": "FP8_DEFAULT_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "NVFP4": "NVFP4_DEFAULT_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "W8A8_SQ_PER_CHANNEL": "INT8_SMOOTHQUANT_CFG",
}
RTN_STOCK = "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"  # W4A16 with plain max calibration (round to nearest)
ALGORITHMS = {  # quant_algo -> calibration algorithms a recipe may ask for
    "FP8": ("max",),
    "FP8_PER_CHANNEL_PER_TOKEN": ("max",),
    "NVFP4": ("max",),
    "W4A16_AWQ": ("awq_lite", "rtn"),
    "W8A8_SQ_PER_CHANNEL": ("smoothquant",),
}
NVFP4_BLOCK = 16


def stock_name(recipe: Recipe) -> str:
    if recipe.quant_algo == "W4A16_AWQ" and recipe.algorithm == "rtn":
        return RTN_STOCK
    return STOCK[recipe.quant_algo]


def stock_config(recipe: Recipe) -> dict:
    """modelopt's own config for the recipe's format, untouched (bench/accuracy.py compares against it)."""
    import modelopt.torch.quantization as mtq

    return copy.deepcopy(getattr(mtq, stock_name(recipe)))


def check_algorithm(recipe: Recipe) -> None:
    allowed = ALGORITHMS[recipe.quant_algo]
    if recipe.algorithm not in allowed:
        raise UserError(f"{recipe.source}: bad value for 'algorithm': {recipe.algorithm!r} does not apply to "
                        f"{recipe.quant_algo} (use {' or '.join(allowed)})")
    if recipe.quant_algo == "NVFP4" and recipe.group_size not in (None, NVFP4_BLOCK):
        raise UserError(f"{recipe.source}: bad value for 'group_size': NVFP4 blocks are {NVFP4_BLOCK} wide")
    if recipe.quant_algo == "W4A16_AWQ" and recipe.group_size is None:
        raise UserError(f"{recipe.source}: missing required key 'group_size' for W4A16_AWQ")


def algorithm_config(recipe: Recipe):
    if recipe.algorithm in ("max", "rtn"):
        return "max"
    return {"method": recipe.algorithm, **recipe.algorithm_args}


def modelopt_config(recipe: Recipe, model=None) -> dict:
    """The modelopt config for a recipe. With `model`, layers whose in_features the group size does not divide
    get their own (smaller) group size, see groups.py."""
    import modelopt.torch.quantization as mtq

    check_algorithm(recipe)
    cfg = stock_config(recipe)
    cfg["algorithm"] = algorithm_config(recipe)
    entries = list(cfg["quant_cfg"])
    if recipe.quant_algo == "W4A16_AWQ":
        entries = [_with_group(e, recipe.group_size) for e in entries]
        if model is not None:
            entries += [_int4_weight_entry(f"{name}.weight_quantizer", group)
                        for name, group in group_overrides(model, recipe.group_size, recipe.exclude).items()]
    entries += [{"quantizer_name": f"*{pattern}*", "enable": False} for pattern in recipe.exclude]
    cfg["quant_cfg"] = entries
    if recipe.kv_cache == "FP8":
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, mtq.FP8_KV_CFG["quant_cfg"])
    return cfg


def _with_group(entry: dict, group: int) -> dict:
    """The stock '*weight_quantizer' entry with the recipe's group size; other entries (exclusions) unchanged."""
    if entry.get("quantizer_name") != "*weight_quantizer" or "cfg" not in entry:
        return entry
    return {**entry, "cfg": {**entry["cfg"], "block_sizes": {**entry["cfg"]["block_sizes"], -1: group}}}


def _int4_weight_entry(quantizer_name: str, group: int) -> dict:
    return {"quantizer_name": quantizer_name, "cfg": {"num_bits": 4, "block_sizes": {-1: group, "type": "static"}}}
