"""Recipe -> nvidia-modelopt quantization config (a plain dict that mtq.quantize takes).

Each quant_algo starts from modelopt's stock config for that format; the recipe then sets the calibration
algorithm and its arguments, the weight group size, the exclusions and the KV-cache quantizers.
"""
import copy

from lowbit import formats
from lowbit.calibrate.groups import group_overrides
from lowbit.errors import UserError
from lowbit.recipe import Recipe


def calibration(recipe: Recipe) -> formats.Calibration:
    """The calibration facts of the recipe's format (recipe validation admits only formats that have them)."""
    return formats.get(recipe.quant_algo).calibration


def stock_name(recipe: Recipe) -> str:
    return calibration(recipe).stock_name(recipe.algorithm)


def stock_config(recipe: Recipe) -> dict:
    """modelopt's own config for the recipe's format, untouched (bench/accuracy.py compares against it)."""
    import modelopt.torch.quantization as mtq

    return copy.deepcopy(getattr(mtq, stock_name(recipe)))


def check_algorithm(recipe: Recipe) -> None:
    calib = calibration(recipe)
    if recipe.algorithm not in calib.algorithms:
        raise UserError(f"{recipe.source}: bad value for 'algorithm': {recipe.algorithm!r} does not apply to "
                        f"{recipe.quant_algo} (use {' or '.join(calib.algorithms)})")
    if recipe.rounding not in calib.roundings:
        raise UserError(f"{recipe.source}: bad value for 'rounding': {recipe.rounding!r} does not apply to "
                        f"{recipe.quant_algo} (use {' or '.join(calib.roundings)})")
    if calib.block is not None and recipe.group_size not in (None, calib.block):
        raise UserError(f"{recipe.source}: bad value for 'group_size': {recipe.quant_algo} blocks are "
                        f"{calib.block} wide")
    if calib.group_required and recipe.group_size is None:
        raise UserError(f"{recipe.source}: missing required key 'group_size' for {recipe.quant_algo}")
    for key in recipe.algorithm_args:
        if key.startswith("joint_clip") and (recipe.algorithm != "awq_full" or recipe.kv_cache is not None):
            raise UserError(f"{recipe.source}: bad value for 'algorithm_args.{key}': applies to awq_full without "
                            "kv_cache (after lowbit's clip search)")
        if key == "awq_lite_samples" and not recipe.algorithm.startswith("awq"):
            raise UserError(f"{recipe.source}: bad value for 'algorithm_args.awq_lite_samples': applies to the AWQ "
                            f"algorithms, not {recipe.algorithm!r}")


# algorithm_args lowbit applies itself (calibrate/loop.py, joint_clip.py); modelopt refuses them
LOWBIT_ARGS = ("awq_lite_samples", "joint_clip", "joint_clip_skip")


def algorithm_config(recipe: Recipe):
    if recipe.algorithm in ("max", "rtn"):
        return "max"
    return {"method": recipe.algorithm, **{k: v for k, v in recipe.algorithm_args.items() if k not in LOWBIT_ARGS}}


def modelopt_config(recipe: Recipe, model=None) -> dict:
    """The modelopt config for a recipe. With `model`, layers whose in_features the group size does not divide
    get their own (smaller) group size, see groups.py."""
    import modelopt.torch.quantization as mtq

    check_algorithm(recipe)
    cfg = stock_config(recipe)
    cfg["algorithm"] = algorithm_config(recipe)
    entries = list(cfg["quant_cfg"])
    if calibration(recipe).group_required:
        entries = [_with_group(e, recipe.group_size) for e in entries]
        if model is not None:
            entries += [_int4_weight_entry(f"{name}.weight_quantizer", group)
                        for name, group in group_overrides(model, recipe.group_size, recipe.exclude).items()]
    entries += [{"quantizer_name": f"*{pattern}*", "enable": False} for pattern in recipe.exclude]
    cfg["quant_cfg"] = entries
    kv = formats.kv_format(recipe.kv_cache)
    if kv is not None:
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, kv.stock)["quant_cfg"])
    return cfg


def _with_group(entry: dict, group: int) -> dict:
    """The stock '*weight_quantizer' entry with the recipe's group size; other entries (exclusions) unchanged."""
    if entry.get("quantizer_name") != "*weight_quantizer" or "cfg" not in entry:
        return entry
    return {**entry, "cfg": {**entry["cfg"], "block_sizes": {**entry["cfg"]["block_sizes"], -1: group}}}


def _int4_weight_entry(quantizer_name: str, group: int) -> dict:
    return {"quantizer_name": quantizer_name, "cfg": {"num_bits": 4, "block_sizes": {-1: group, "type": "static"}}}
