"""Gates: thresholds on comparison metrics, and a decision that does not fail on noise alone.

A threshold `metric >= t` (or `<= t`) on a value v with standard error se is judged at a one-sided confidence
level c (default 0.95): with the critical value k (normal quantile of c, 1.645; or Student's t quantile when se
comes from few sequences, as for the held-out-text metrics),
  pass          v meets the threshold;
  within noise  v misses it, but by less than k*se: the data cannot tell it from a model that meets it -> passes;
  fail          v misses it by more than k*se: with confidence c the true value is on the wrong side.
Ratios (ppl_ratio) are judged in logs. With --confidence 0 every threshold is judged on the point estimate.
"""
import math
import re
from dataclasses import dataclass
from statistics import NormalDist

from lowbit.errors import UserError

METRICS = ("recovery", "ppl_ratio", "kl", "top1")  # or TASK.recovery for one task
TEXT_METRICS = ("ppl_ratio", "kl", "top1")  # measured by the `ppl` task
LOG_SCALE = {"ppl_ratio"}  # judged as log(value) against log(threshold); their se is that of log(value)
RECIPE_KEYS = {f"{side}_{m}": (m, op) for m in METRICS for side, op in (("min", ">="), ("max", "<="))}
_SPEC = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Threshold:
    metric: str
    op: str  # ">=" or "<="
    value: float

    def __str__(self):
        return f"{self.metric}{self.op}{self.value:g}"


def _check_metric(name: str, where: str) -> str:
    base = name.rsplit(".", 1)[-1]
    if base not in METRICS or (name != base and base != "recovery"):
        raise UserError(f"{where}: unknown gate metric {name!r}; known: {', '.join(METRICS)}, or TASK.recovery")
    return name


def _threshold(metric: str, op: str, value: float, where: str) -> Threshold:
    if metric in LOG_SCALE and value <= 0:
        raise UserError(f"{where}: {metric} is a ratio; its threshold must be positive, got {value:g}")
    return Threshold(metric, op, value)


def parse_spec(spec: str) -> list[Threshold]:
    """'recovery>=0.99,kl<=0.02' -> thresholds."""
    out = []
    for part in spec.split(","):
        m = _SPEC.match(part)
        if not m:
            raise UserError(f"--gate: cannot read {part.strip()!r}; write METRIC>=NUMBER or METRIC<=NUMBER, "
                            f"comma-separated, e.g. \"recovery>=0.99,kl<=0.02\"")
        try:
            value = float(m.group(3))
        except ValueError as e:
            raise UserError(f"--gate: {m.group(3)!r} is not a number") from e
        out.append(_threshold(_check_metric(m.group(1), "--gate"), m.group(2), value, "--gate"))
    return out


def from_recipe(gate: dict, where: str = "recipe gate") -> list[Threshold]:
    """A recipe's `gate:` mapping ({min_recovery: 0.98, max_kl: 0.02, ...}) -> thresholds."""
    out = []
    for key, value in gate.items():
        if key not in RECIPE_KEYS:
            raise UserError(f"{where}: unknown key {key!r}; known: {', '.join(sorted(RECIPE_KEYS))}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: {key} must be a number, got {value!r}")
        metric, op = RECIPE_KEYS[key]
        out.append(_threshold(metric, op, float(value), where))
    return out


def check_confidence(confidence: float) -> float:
    if not 0 <= confidence < 1:
        raise UserError(f"--confidence must be in [0, 1), got {confidence}")
    return confidence


def critical_value(confidence: float, dof: int | None = None) -> float:
    """One-sided critical value: normal, or Student's t when the standard error comes from few samples (dof)."""
    if confidence == 0:
        return 0.0
    if dof:
        from scipy.stats import t

        return float(t.ppf(confidence, dof))
    return NormalDist().inv_cdf(confidence)


def judge(t: Threshold, value, se, crit: float) -> str:
    """'pass', 'within noise' (passes), 'fail', or 'missing' (no finite value: fails).

    For LOG_SCALE metrics (ratios) se is the standard error of log(value) and the comparison is made in logs.
    """
    if value is None or not math.isfinite(value) or (t.metric in LOG_SCALE and value <= 0):
        return "missing"
    v, thr = (math.log(value), math.log(t.value)) if t.metric in LOG_SCALE else (value, t.value)
    margin = (v - thr) if t.op == ">=" else (thr - v)  # >= 0 meets the threshold
    if margin >= 0:
        return "pass"
    noise = crit * se if se is not None and math.isfinite(se) else 0.0
    return "within noise" if -margin <= noise else "fail"


def decide(thresholds: list[Threshold], metrics: dict, confidence: float) -> tuple[bool, list[dict]]:
    """metrics: name -> (value, se) or (value, se, dof). Returns (passed, one row per threshold)."""
    rows = []
    for t in thresholds:
        value, se, dof = (list(metrics.get(t.metric, ())) + [None, None, None])[:3]
        crit = critical_value(confidence, dof)
        rows.append({"gate": str(t), "metric": t.metric, "op": t.op, "threshold": t.value, "value": value,
                     "se": se, "critical": crit, "scale": "log" if t.metric in LOG_SCALE else "linear",
                     "verdict": judge(t, value, se, crit)})
    return all(r["verdict"] in ("pass", "within noise") for r in rows), rows
