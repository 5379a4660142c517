"""Recipes -> modelopt configs: every shipped recipe loads and maps; group-size rule; algorithm checks."""
import pytest
import torch
from torch import nn

from lowbit.calibrate.configs import modelopt_config, stock_name
from lowbit.calibrate.groups import group_overrides, layer_group
from lowbit.errors import UserError
from lowbit.recipe import available, load_recipe, recipe_from_dict

SHIPPED = {"fp8": "FP8_DEFAULT_CFG", "fp8_dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG", "nvfp4": "NVFP4_DEFAULT_CFG",
           "int4_awq": "INT4_AWQ_CFG", "int4_rtn": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "w8a8_sq": "INT8_SMOOTHQUANT_CFG"}


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.down_proj, self.lm_head = nn.Linear(576, 576), nn.Linear(1536, 576), nn.Linear(576, 100)


def entries(cfg, name):
    return [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == name]


def test_all_recipes_ship_and_map_to_their_stock_format():
    assert set(SHIPPED) <= set(available())
    for name, stock in SHIPPED.items():
        recipe = load_recipe(name)
        assert stock_name(recipe) == stock
        cfg = modelopt_config(recipe)
        assert {"quantizer_name": "*lm_head*", "enable": False} in cfg["quant_cfg"]
        has_kv = any("bmm_quantizer" in e.get("quantizer_name", "") for e in cfg["quant_cfg"])
        assert has_kv == (recipe.kv_cache == "FP8"), name


def test_algorithm_arguments_reach_modelopt():
    assert modelopt_config(load_recipe("w8a8_sq"))["algorithm"] == {"method": "smoothquant", **load_recipe("w8a8_sq").algorithm_args}
    assert modelopt_config(load_recipe("int4_awq"))["algorithm"]["method"] == "awq_full"
    assert modelopt_config(load_recipe("int4_rtn"))["algorithm"] == "max"
    fp8_mse = recipe_from_dict({**load_recipe("fp8").to_dict(), "algorithm": "mse"})
    assert modelopt_config(fp8_mse)["algorithm"] == {"method": "mse"}  # modelopt's MSE search of weight amax


def test_int4_group_size_set_without_reenabling_excluded_modules():
    cfg = modelopt_config(load_recipe("int4_awq"), TinyBlock())
    weight = entries(cfg, "*weight_quantizer")
    assert len(weight) == 1 and weight[0]["cfg"]["block_sizes"][-1] == 128
    names = [e["quantizer_name"] for e in cfg["quant_cfg"]]
    assert names.index("*weight_quantizer") < names.index("*lm_head*")  # later entries win in modelopt
    assert entries(cfg, "q_proj.weight_quantizer")[0]["cfg"]["block_sizes"][-1] == 64
    assert not entries(cfg, "down_proj.weight_quantizer") and not entries(cfg, "lm_head.weight_quantizer")


def test_layer_group_rule():
    assert layer_group(576, 128) == 64
    assert layer_group(1536, 128) == 128
    assert layer_group(96, 128) == 32
    with pytest.raises(UserError, match="in_features 100"):
        layer_group(100, 128)
    assert group_overrides(TinyBlock(), 128, exclude=("lm_head",)) == {"q_proj": 64}


@pytest.mark.parametrize("change, message", [
    ({"algorithm": "smoothquant"}, "'algorithm'"),
    ({"algorithm": "mse"}, "'algorithm'"),
    ({"group_size": 32, "quant_algo": "NVFP4", "algorithm": "max"}, "'group_size'"),
    ({"group_size": None}, "'group_size'"),
])
def test_bad_combinations_name_the_key_and_file(change, message):
    recipe = recipe_from_dict({**load_recipe("int4_awq").to_dict(), **change}, source="my.yaml")
    with pytest.raises(UserError, match=message) as e:
        modelopt_config(recipe)
    assert "my.yaml" in str(e.value)


def test_kv_check_rejects_an_uncalibrated_layer():
    from lowbit.calibrate.kv import check_kv_calibrated

    class Q:
        is_enabled = True

        def __init__(self, amax):
            self.amax = amax

    attn = nn.Module()
    attn.k_bmm_quantizer, attn.v_bmm_quantizer = Q(torch.tensor(3.0)), Q(None)
    model = nn.Sequential(attn)
    with pytest.raises(RuntimeError, match="v cache quantizer is not calibrated"):
        check_kv_calibrated(model)
