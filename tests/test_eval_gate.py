"""Gate specs, recipe gates and the noise-aware decision (no model needed)."""
import math

import pytest

from lowbit.errors import UserError
from lowbit.evaluate import gate
from lowbit.recipe import load_recipe


def test_parse_spec():
    ts = gate.parse_spec("recovery>=0.99, kl<=0.02,arc_easy.recovery>=0.9")
    assert [str(t) for t in ts] == ["recovery>=0.99", "kl<=0.02", "arc_easy.recovery>=0.9"]


@pytest.mark.parametrize("spec", ["recovery>0.99", "recovery>=x", "accuracy>=0.9", "", "kl<=0.02,", "foo.kl<=1"])
def test_parse_spec_rejects(spec):
    with pytest.raises(UserError):
        gate.parse_spec(spec)


def test_recipe_gate_becomes_thresholds():
    ts = gate.from_recipe(load_recipe("fp8").gate)
    assert {str(t) for t in ts} == {"recovery>=0.98", "ppl_ratio<=1.03"}
    with pytest.raises(UserError, match="unknown key"):
        gate.from_recipe({"min_accuracy": 0.9})
    with pytest.raises(UserError, match="number"):
        gate.from_recipe({"max_kl": "low"})


def test_judge_uses_noise_only_to_forgive_small_misses():
    t = gate.Threshold("recovery", ">=", 0.98)
    z = gate.critical_value(0.95)
    assert math.isclose(z, 1.6449, abs_tol=1e-3)
    assert math.isclose(gate.critical_value(0.95, dof=3), 2.353, abs_tol=1e-3)
    assert gate.judge(t, 0.99, 0.05, z) == "pass"
    assert gate.judge(t, 0.95, 0.05, z) == "within noise"  # misses by 0.03 < 1.645 * 0.05
    assert gate.judge(t, 0.80, 0.05, z) == "fail"
    assert gate.judge(t, 0.95, 0.05, 0.0) == "fail"  # --confidence 0: point estimates
    assert gate.judge(t, float("nan"), 0.05, z) == "missing"
    upper = gate.Threshold("kl", "<=", 0.02)
    assert gate.judge(upper, 0.021, 0.001, z) == "within noise"
    assert gate.judge(upper, 0.03, 0.001, z) == "fail"


def test_ratios_are_judged_in_logs():
    t = gate.Threshold("ppl_ratio", "<=", 1.03)
    z = gate.critical_value(0.95)
    assert gate.judge(t, 1.05, 0.02, z) == "within noise"  # log(1.05/1.03) = 0.019 < 1.645 * 0.02
    assert gate.judge(t, 1e5, 1.0, z) == "fail"  # a huge ratio with a huge linear se is still a failure
    with pytest.raises(UserError, match="positive"):
        gate.parse_spec("ppl_ratio<=0")


def test_decide():
    ts = gate.parse_spec("recovery>=0.98,kl<=0.02")
    passed, rows = gate.decide(ts, {"recovery": (0.97, 0.02), "kl": (0.01, 0.001, 7)}, 0.95)
    assert passed and [r["verdict"] for r in rows] == ["within noise", "pass"]
    passed, rows = gate.decide(ts, {"recovery": (0.97, 0.02)}, 0.95)
    assert not passed and rows[1]["verdict"] == "missing"


def test_confidence_range():
    with pytest.raises(UserError):
        gate.check_confidence(1.0)
    assert gate.critical_value(0) == 0


def test_json_report_is_strict(tmp_path):
    import json

    from lowbit.evaluate.report import write_json

    write_json({"summary": {"recovery": (float("nan"), 0.1)}, "n": 3}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == {"summary": {"recovery": [None, 0.1]}, "n": 3}
