"""KV scale search (calibrate/kv.py): the chosen k/v multipliers minimise calibration NLL over the grid, the
quantizers keep amax = max-calibrated amax x multiplier, and bad recipe values fail with one line."""
import pytest
import torch

from lowbit.calibrate.data import load_texts, token_batches
from lowbit.calibrate.kv import calibration_nll, kv_quantizers, search_kv_scales
from lowbit.calibrate.loop import calibrate
from lowbit.errors import UserError
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe, recipe_from_dict

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def calibrated(embedded_model_dir):
    """The embedded model (a random tiny model's NLL barely moves with its k/v scales), FP8 + FP8 KV."""
    model, tok = load_float_model(embedded_model_dir)
    batches = token_batches(tok, load_texts("builtin:boolq"), 4, 128, seed=0)
    calibrate(model, load_recipe("fp8"), batches)
    base = {name: (k.amax.clone(), v.amax.clone()) for name, (k, v) in kv_quantizers(model).items()}
    return model, batches, base


def reset(model, base):
    for name, (k, v) in kv_quantizers(model).items():
        k.amax, v.amax = base[name][0].clone(), base[name][1].clone()


def test_search_picks_the_lowest_nll(calibrated):
    model, batches, base = calibrated
    reset(model, base)
    grid = (0.05, 1.0, 2.0, 3.0)  # 0.05 clips nearly every key and value: never the best
    ck, cv = search_kv_scales(model, batches, grid)
    chosen = calibration_nll(model, batches[:4])
    for name, (k, v) in kv_quantizers(model).items():
        assert torch.allclose(k.amax, base[name][0] * ck) and torch.allclose(v.amax, base[name][1] * cv)
    k_scores, v_scores = {}, {}
    for c in grid:
        k_scores[c] = nll_at(model, base, batches, c, 1.0)
        v_scores[c] = nll_at(model, base, batches, ck, c)
    print(f"chosen k x {ck}, v x {cv}: NLL {chosen:.5f}; k grid (v x 1): {k_scores}; v grid (k x {ck}): {v_scores}")
    assert ck != 0.05 and cv != 0.05
    assert k_scores[ck] == min(k_scores.values()) and v_scores[cv] == min(v_scores.values())
    assert chosen == v_scores[cv]


def nll_at(model, base, batches, ck, cv) -> float:
    for name, (k, v) in kv_quantizers(model).items():
        k.amax, v.amax = base[name][0] * ck, base[name][1] * cv
    return calibration_nll(model, batches[:4])


@pytest.mark.parametrize("bad,msg", [({"kv_scale_search": "yes"}, "not true or false"),
                                     ({"kv_scale_search": True, "kv_cache": None}, "needs a kv_cache")])
def test_bad_kv_scale_search_values(bad, msg):
    with pytest.raises(UserError, match=msg) as e:
        recipe_from_dict({**load_recipe("fp8").to_dict(), **bad})
    assert "\n" not in str(e.value)
