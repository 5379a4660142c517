"""Recipe -> nvidia-modelopt quantization config (a plain dict that mtq.quantize takes)."""
import copy

from lowbit.recipe import Recipe


def _stock_config(recipe: Recipe) -> dict:
    import modelopt.torch.quantization as mtq

    stock = {
        ("FP8", "max"): mtq.FP8_DEFAULT_CFG,
    }
    key = (recipe.quant_algo, recipe.algorithm)
    if key not in stock:
        raise NotImplementedError(f"no modelopt configuration for quant_algo={recipe.quant_algo} algorithm={recipe.algorithm}")
    return copy.deepcopy(stock[key])


def modelopt_config(recipe: Recipe) -> dict:
    """The modelopt config for a recipe: its stock format config, the recipe's exclusions, and KV-cache quantizers."""
    import modelopt.torch.quantization as mtq

    cfg = _stock_config(recipe)
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [
        {"quantizer_name": f"*{pattern}*", "enable": False} for pattern in recipe.exclude
    ]
    if recipe.kv_cache == "FP8":
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, mtq.FP8_KV_CFG["quant_cfg"])
    return cfg
