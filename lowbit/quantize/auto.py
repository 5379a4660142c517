"""`quantize --recipe auto --gate SPEC [--max-bits B]`: per-unit sensitivity, a search over lowbit's formats under a
size budget, and the evaluate runner's gate on each candidate mix, smallest first; the first that passes is kept."""
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit import formats, models
from lowbit.calibrate import sensitivity as sens
from lowbit.calibrate.groups import layer_group
from lowbit.errors import UserError
from lowbit.quantize import auto_search

CANDIDATES = ("int4_awq", "nvfp4", "w8a8_sq", "fp8")  # recipes whose format and group size a unit may take
FLOAT = "bf16"  # a unit left in the model's 16-bit dtype


@dataclass
class AutoSettings:
    gate: str  # e.g. "recovery>=0.99" or "kl<=0.05"
    max_bits: float = 16.0  # average stored bits per quantized-linear weight (scales included)
    tasks: list | None = None  # default: what the gate's metrics need
    limit: int | None = 200
    confidence: float = 0.95
    trials: int = 4  # candidate mixes gated at most
    calib_samples: int = 4  # sensitivity: calibration sequences of seq_len tokens
    seq_len: int = 256
    workers: int = 1
    candidates: tuple = CANDIDATES
    exclude: tuple = ("lm_head",)
    log: list = field(default_factory=list)


def gate_tasks(thresholds) -> list[str]:
    from lowbit.evaluate.cli import DEFAULT_TASKS
    from lowbit.evaluate.gate import TEXT_METRICS

    tasks = ["ppl"] if any(t.metric in TEXT_METRICS for t in thresholds) else []
    if any(t.metric == "recovery" for t in thresholds):
        tasks += [t for t in DEFAULT_TASKS if t != "ppl"]
    tasks += [t.metric.rsplit(".", 1)[0] for t in thresholds if t.metric.endswith(".recovery")]
    return list(dict.fromkeys(tasks))


def auto_quantize(model: str, settings: AutoSettings, out=None, force: bool = False) -> tuple[int, dict]:
    """(exit code 0 passed / 1 nothing passed, report). Writes the passing mix (else the best tried) to `out`."""
    from lowbit.evaluate import gate as gates
    from lowbit.evaluate.cli import check_gate_needs
    from lowbit.evaluate.runner import Plan, Side
    from lowbit.quantize.api import load_float_model

    thresholds = gates.parse_spec(settings.gate)
    gates.check_confidence(settings.confidence)
    plan = Plan(tasks=settings.tasks or gate_tasks(thresholds), limit=settings.limit, workers=settings.workers)
    src = models.resolve(model)
    baseline = Side(str(model), src)
    check_gate_needs(thresholds, baseline, plan, "inproc")
    out = Path(out) if out else models.store_path(f"{Path(str(model)).name}-auto")
    if out.exists() and not force:
        raise UserError(f"output {out} already exists (use --force to overwrite)")
    hf_model, tokenizer = load_float_model(src)
    table, params, choices, stats = profile(hf_model, tokenizer, settings)
    path = auto_search.upgrade_path(table, params)
    mixes = auto_search.trials(path, table, params, settings.max_bits, settings.trials)
    report = {"model": str(model), "gate": settings.gate, "max_bits": settings.max_bits, "tasks": plan.tasks,
              "limit": plan.limit, "smallest_bits": auto_search.average_bits(path[0], table, params), "trials": []}
    if not mixes:
        report["passed"] = False
        report["error"] = f"no mix fits --max-bits {settings.max_bits}"
        return 1, report
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.auto-", dir=out.parent if out.parent.exists() else None))
    try:
        chosen = None
        for i, mix in enumerate(mixes):
            trial = work / f"trial{i}"
            write(hf_model, tokenizer, mix, choices, stats, trial, str(model), settings)
            record = gate_trial(trial, baseline, plan, thresholds, settings.confidence)
            record.update(mix_summary(mix, table, params), size_mb=_mb(trial))
            report["trials"].append(record)
            print(f"[lowbit] auto trial {i + 1}/{len(mixes)}: {record['bits']:.2f} bits/weight "
                  f"{record['counts']} -> gate {'PASSED' if record['passed'] else 'failed'}", file=sys.stderr)
            chosen = mix
            if record["passed"]:
                break
        write(hf_model, tokenizer, chosen, choices, stats, out, str(model), settings, force=force)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["passed"] = report["trials"][-1]["passed"]
    report["chosen"] = report["trials"][-1] | {"checkpoint": str(out)}
    return (0 if report["passed"] else 1), report


def candidate_choices(names) -> dict[str, sens.Choice]:
    """{recipe name: how a unit takes that recipe's format}: its format, group size and NVFP4 block-scale search."""
    from lowbit.recipe import load_recipe

    recipes = [load_recipe(name) for name in names]
    return {r.name: sens.Choice(r.name, formats.get(r.quant_algo), r.group_size or 128, r.weight_scale_search)
            for r in recipes}


def profile(model, tokenizer, settings: AutoSettings):
    """({unit: {label: Option}}, {unit: weight count}, {label: Choice}, sens.InputStats) on calibration text."""
    from lowbit.calibrate.data import load_texts, token_batches

    choices = candidate_choices(settings.candidates)
    ids = token_batches(tokenizer, load_texts("builtin:boolq", "calib"), settings.calib_samples, settings.seq_len)
    batches = [torch.tensor([b]) for b in ids]
    units = sens.units(model, settings.exclude)
    stats = sens.input_stats(model, batches, [n for u in units for n in u])
    ref = sens.reference_logprobs(model, batches)
    table, params = {}, {}
    for k, unit in enumerate(units):
        params[unit] = sum(model.get_submodule(n).weight.numel() for n in unit)
        table[unit] = {FLOAT: auto_search.Option(FLOAT, 0.0, 16.0)}
        for label, choice in choices.items():
            tensors = sens.quantize_unit(model, unit, choice, stats)
            kl = sens.kl_with(model, batches, ref, tensors, choice.fmt)
            table[unit][label] = auto_search.Option(label, kl, sens.bits_per_weight(tensors, params[unit]))
        print(f"[lowbit] auto sensitivity {k + 1}/{len(units)} {unit[0].rsplit('.', 1)[0]}: "
              + ", ".join(f"{o.label} {o.kl:.2e}" for o in table[unit].values()), file=sys.stderr)
    return table, params, choices, stats


def write(model, tokenizer, mix: dict, choices: dict, stats, out: Path, source: str, settings,
          force: bool = True) -> None:
    from lowbit.evaluate import gate as gates
    from lowbit.formats.layers import MIXED_PRECISION
    from lowbit.quantize.auto_write import write_mixed

    tensors, entries = {}, {}
    for unit, label in mix.items():
        if label == FLOAT:
            continue
        choice = choices[label]
        tensors.update(sens.quantize_unit(model, unit, choice, stats))
        for name in unit:
            entry = {"quant_algo": choice.fmt.name}
            if choice.fmt.calibration and choice.fmt.calibration.group_required:
                entry["group_size"] = layer_group(model.get_submodule(name).in_features, choice.group)
            entries[name] = entry
    gate = {}
    for t in gates.parse_spec(settings.gate):  # what `lowbit eval CKPT` then gates on by default
        key = f"{'min' if t.op == '>=' else 'max'}_{t.metric}"
        if key in gates.RECIPE_KEYS:
            gate[key] = t.value
    recipe = {"name": "auto", "description": f"per-layer mix searched under the gate {settings.gate}",
              "quant_algo": MIXED_PRECISION, "max_bits": settings.max_bits, "gate": gate}
    write_mixed(model, tokenizer, tensors, entries, Path(out), source, recipe, force=force)


def gate_trial(path: Path, baseline, plan, thresholds, confidence: float) -> dict:
    from lowbit.evaluate import gate as gates
    from lowbit.evaluate.runner import Side, evaluate

    result = evaluate(Side(str(path), path), baseline, plan)
    passed, rows = gates.decide(thresholds, result["summary"], confidence)
    return {"passed": passed, "gate": rows, "summary": result["summary"], "timing_s": result["timing_s"]}


def mix_summary(mix: dict, table: dict, params: dict) -> dict:
    counts = {}
    for label in mix.values():
        counts[label] = counts.get(label, 0) + 1
    return {"bits": auto_search.average_bits(mix, table, params), "counts": counts,
            "layers": {",".join(u): label for u, label in mix.items()},
            "predicted_kl": sum(table[u][label].kl for u, label in mix.items())}


def _mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20


def print_report(report: dict) -> None:
    """The trials, the chosen mix, its size and its gate result, for people (stdout)."""
    print(f"auto: {report['model']}, gate {report['gate']}, max {report['max_bits']} bits/weight, "
          f"tasks {','.join(report['tasks'])}, limit {report['limit']}")
    if report.get("error"):
        print(f"nothing passes: {report['error']} (the smallest mix has {report['smallest_bits']:.2f})")
        return
    print("| trial | bits/weight | size MB | mix (units per choice) | gate | values |")
    print("|---|---|---|---|---|---|")
    for i, t in enumerate(report["trials"]):
        values = ", ".join(f"{r['gate']}: {_num(r.get('value'))} {r['verdict']}" for r in t["gate"])
        print(f"| {i + 1} | {t['bits']:.2f} | {t['size_mb']:.1f} | {t['counts']} | "
              f"{'PASSED' if t['passed'] else 'failed'} | {values} |")
    c = report["chosen"]
    verdict = "PASSED" if report["passed"] else "FAILED: no mix passed; the best tried is written"
    print(f"gate {verdict}: {c['checkpoint']}, {c['bits']:.2f} bits/weight, {c['size_mb']:.1f} MB, {c['counts']}")


def _num(v):
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)
