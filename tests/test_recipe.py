import pytest

from lowbit.errors import UserError
from lowbit.recipe import available, load_recipe


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_fp8_recipe_loads_by_name():
    r = load_recipe("fp8")
    assert r.quant_algo == "FP8" and r.kv_cache == "FP8" and r.algorithm == "max"
    assert "lm_head" in r.exclude
    assert r.calibration.data == "builtin:boolq" and r.calibration.seq_len == 512
    assert "fp8" in available()


def test_recipe_loads_by_path(tmp_path):
    p = write(tmp_path, "name: mine\nquant_algo: FP8\ncalibration: {num_samples: 2, seq_len: 32}\n")
    r = load_recipe(str(p))
    assert (r.name, r.calibration.num_samples, r.calibration.seq_len) == ("mine", 2, 32)
    assert r.kv_cache is None and r.exclude == ("lm_head",)


def test_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, "name: x\nquant_algo: FP8\nkv_cahce: FP8\n")
    with pytest.raises(UserError, match=r"r\.yaml.*unknown key 'kv_cahce'"):
        load_recipe(str(p))


def test_unknown_nested_key(tmp_path):
    p = write(tmp_path, "name: x\nquant_algo: FP8\ncalibration: {samples: 3}\n")
    with pytest.raises(UserError, match=r"unknown key 'calibration\.samples'"):
        load_recipe(str(p))


@pytest.mark.parametrize("text, key", [
    ("name: x\nquant_algo: FP9\n", "quant_algo"),
    ("name: x\nquant_algo: FP8\nkv_cache: INT3\n", "kv_cache"),
    ("name: x\nquant_algo: FP8\nalgorithm: magic\n", "algorithm"),
    ("name: x\nquant_algo: FP8\ngroup_size: -4\n", "group_size"),
    ("name: x\nquant_algo: FP8\ncalibration: {num_samples: 0}\n", "calibration.num_samples"),
    ("name: x\nquant_algo: FP8\ncalibration: {seq_len: many}\n", "calibration.seq_len"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(UserError, match=rf"bad value for '{key}'"):
        load_recipe(str(write(tmp_path, text)))


def test_missing_required_key(tmp_path):
    with pytest.raises(UserError, match="missing required key 'quant_algo'"):
        load_recipe(str(write(tmp_path, "name: x\n")))


def test_malformed_yaml_names_file_and_line(tmp_path):
    p = write(tmp_path, "name: x\nquant_algo: [FP8\n")
    with pytest.raises(UserError, match=r"r\.yaml:.*malformed YAML"):
        load_recipe(str(p))


def test_unknown_recipe_lists_available():
    with pytest.raises(UserError, match="unknown recipe 'fp7'.*fp8"):
        load_recipe("fp7")
