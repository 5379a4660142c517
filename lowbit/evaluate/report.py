"""The report: a markdown table for people (stdout) and JSON for machines (--report FILE)."""
import json
import math


def _pm(pair, digits: int = 3, scale: float = 1.0) -> str:
    value, se = pair[:2]
    if value is None or not math.isfinite(value):
        return "n/a"
    if se is None or not math.isfinite(se):
        return f"{value * scale:.{digits}f}"
    return f"{value * scale:.{digits}f} ± {se * scale:.{digits}f}"


def task_lines(result: dict) -> list[str]:
    with_base = any("recovery" in row for row in result["tasks"].values())
    head = "| task | metric | n | baseline | candidate | recovery |" if with_base else "| task | metric | n | score |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, row in result["tasks"].items():
        if with_base:
            lines.append(f"| {name} | {row['metric']} | {row['n']} | {_pm(row['baseline'])} | "
                         f"{_pm(row['candidate'])} | {_pm(row['recovery'])} |")
        else:
            lines.append(f"| {name} | {row['metric']} | {row['n']} | {_pm(row['candidate'])} |")
    return lines


def text_lines(text: dict | None) -> list[str]:
    if not text:
        return []
    lines = ["", "| held-out text | baseline ppl | candidate ppl |", "|---|---|---|"]
    for source, ppl in text["ppl"].items():
        base = f"{ppl['baseline']:.3f}" if "baseline" in ppl else "-"
        lines.append(f"| {source} | {base} | {ppl['candidate']:.3f} |")
    if "ppl_ratio" in text:
        ratio, log_se = text["ppl_ratio"][:2]
        kl = "n/a (server)" if text["kl"] is None else f"{_pm(text['kl'], 5)} nats/token"
        top1 = "n/a (server)" if text["top1"] is None else _pm(text["top1"], 4)
        lines += ["", f"ppl ratio {ratio:.4f} (se of log {log_se:.4f}) · KL(baseline‖candidate) {kl}"
                  f" · top-1 agreement {top1} · {text['tokens']} tokens"
                  f" (baseline mass outside its top-{text['top_k']}: {text['tail_mass']:.3f})"]
    return lines


def gate_lines(gate: dict | None) -> list[str]:
    if not gate:
        return []
    lines = ["", "| gate | value | noise band (k·se) | verdict |", "|---|---|---|---|"]
    for row in gate["rows"]:
        value = "missing" if row["value"] is None else f"{row['value']:.4f}"
        lines.append(f"| {row['gate']} | {value} | {_band(row)} | {row['verdict'].upper()} |")
    verdict = "PASSED" if gate["passed"] else "FAILED"
    lines += ["", f"**gate {verdict}** (one-sided confidence {gate['confidence']:g}: a value that misses a threshold "
                  f"by less than its noise band passes as within noise)"]
    return lines


def _band(row: dict) -> str:
    se = row["se"]
    if se is None or not math.isfinite(se):
        return "-"
    if row["scale"] == "log":
        return f"×/÷ {math.exp(row['critical'] * se):.4f}"
    return f"± {row['critical'] * se:.4f}"


def markdown(result: dict) -> str:
    lines = [f"## lowbit eval: {result['candidate']['name']}"
             + (f" vs {result['baseline']['name']}" if result.get("baseline") else ""), ""]
    if result["tasks"]:
        lines += task_lines(result)
    lines += text_lines(result["text"])
    summary = result.get("summary") or {}
    if "recovery" in summary:
        lines += ["", f"recovery (mean over {len(result['tasks'])} tasks): {_pm(summary['recovery'], 4)}"]
    lines += gate_lines(result.get("gate"))
    cached = result.get("baseline_cached")
    timing = result["timing_s"]
    lines += ["", f"time: baseline {timing['baseline']} s" + (f" (cached: {', '.join(cached)})" if cached else "")
              + f", candidate {timing['candidate']} s"]
    return "\n".join(lines)


def write_json(result: dict, path) -> None:
    """Strict JSON: NaN and infinities (e.g. recovery when the baseline scored 0) become null."""
    with open(path, "w") as f:
        json.dump(_finite(result), f, indent=2, allow_nan=False)
        f.write("\n")


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
