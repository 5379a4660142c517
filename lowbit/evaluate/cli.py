"""`lowbit eval`: score a model or checkpoint, compare it with its baseline, and gate it (exit 0 pass, 1 fail)."""
import argparse
import logging

from lowbit.errors import UserError

DEFAULT_TASKS = ("arc_easy", "hellaswag", "piqa", "ppl")  # lambada: on request (see docs/evaluate.md)

EXAMPLES = """\
examples:
  lowbit eval smollm2-135m-fp8                          # baseline from the checkpoint's manifest, gate from its recipe
  lowbit eval smollm2-135m-fp8 --baseline smollm2-135m --gate "recovery>=0.98,kl<=0.02" --limit 200
  lowbit eval ./my-ckpt --tasks arc_easy,piqa,ppl --limit 100 --report gate.json
  lowbit eval smollm2-135m --tasks hellaswag --limit 50    # scores only: no baseline, no gate
  lowbit eval smollm2-135m-fp8 --backend server --url http://localhost:8000 --tasks arc_easy

tasks: arc_easy arc_challenge hellaswag piqa (lm-eval's prompts and metrics, shipped validation data), lambada
  (last-word accuracy), ppl (perplexity, KL and top-1 agreement with the baseline on held-out text), or any other
  lm-eval task name or task YAML path (needs that task's data).
gate metrics: recovery (mean over tasks of candidate/baseline), TASK.recovery, ppl_ratio, kl, top1.
exit codes: 0 passed (or no gate), 1 gate failed, 2 usage or input error (one line), 3 internal error
  (a traceback, then one line): a CI job can tell a bad checkpoint from a broken tool.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_OR_CHECKPOINT", help="store name, checkpoint directory or HF model dir")
    p.add_argument("--baseline", metavar="MODEL", help="the unquantized model (default: the checkpoint's source model)")
    p.add_argument("--tasks", nargs="+", metavar="TASK", help=f"comma- or space-separated (default: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--limit", type=int, metavar="N", help="first N documents per task (default: all)")
    p.add_argument("--ppl-seqs", type=int, metavar="N",
                   help="held-out sequences of 512 tokens per text source (BoolQ, LAMBADA) for ppl/KL (default 4)")
    p.add_argument("--gate", metavar="SPEC", help='thresholds, e.g. "recovery>=0.99,kl<=0.02" (default: the recipe\'s gate)')
    p.add_argument("--no-gate", action="store_true", help="report only, even if the checkpoint's recipe has a gate")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="one-sided confidence before a miss counts as a failure (0: judge point estimates)")
    p.add_argument("--report", metavar="FILE", help="write the full result as JSON")
    p.add_argument("--backend", choices=("inproc", "server"), default="inproc")
    p.add_argument("--url", help="base URL of an OpenAI-compatible server (with --backend server)")
    p.add_argument("--no-cache", action="store_true", help="recompute the baseline even if cached")
    p.add_argument("--workers", type=int, metavar="N",
                   help="in-process scoring: documents shared out over N processes, each batching as --batch says "
                        "(default 1: measured fastest on a shared 2-core machine)")
    p.add_argument("--packed", action="store_true",
                   help="in-process scoring: documents in padded batches, faster; loglikelihoods equal to one "
                        "document at a time up to float rounding, so a fake-quantized model's per-document scores "
                        "can differ in a few documents (docs/evaluate.md)")
    p.add_argument("--batch", type=int, metavar="N",
                   help="in-process scoring: N documents run in lockstep, sharing their GEMMs; same scores bit for bit "
                        "(default 16; 1: one at a time)")


def run(args) -> int:
    from lowbit.evaluate import gate as gates
    from lowbit.evaluate.lockstep import DEFAULT_BATCH
    from lowbit.evaluate.parallel import default_workers
    from lowbit.evaluate.report import markdown, write_json
    from lowbit.evaluate.runner import Plan, evaluate

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notices would bury the progress bars
    plan = Plan(tasks=parse_tasks(args.tasks), limit=check_positive("--limit", args.limit),
                text_seqs=check_positive("--ppl-seqs", args.ppl_seqs) or Plan.text_seqs, use_cache=not args.no_cache,
                workers=check_positive("--workers", args.workers) or default_workers(),
                batch=check_positive("--batch", args.batch) or DEFAULT_BATCH, exact=not args.packed)
    gates.check_confidence(args.confidence)
    candidate, baseline, thresholds = resolve_sides(args)
    check_gate_needs(thresholds, baseline, plan, args.backend)
    result = evaluate(candidate, baseline, plan)
    result["candidate"] = {"name": args.model, "path": str(candidate.path), "backend": args.backend}
    result["baseline"] = {"name": baseline.name, "path": str(baseline.path)} if baseline else None
    result["settings"] = {"tasks": plan.tasks, "limit": plan.limit, "text_sequences": plan.text_seqs}
    passed = True
    if thresholds:
        passed, rows = gates.decide(thresholds, result["summary"], args.confidence)
        result["gate"] = {"passed": passed, "confidence": args.confidence, "rows": rows}
    print(markdown(result))
    if args.report:
        write_json(result, args.report)
    return 0 if passed else 1


def parse_tasks(values) -> list[str]:
    from lowbit.evaluate.tasks import check_task_names

    if not values:
        return list(DEFAULT_TASKS)
    tasks = [t.strip() for v in values for t in v.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks: no task names given")
    check_task_names(tasks)
    return list(dict.fromkeys(tasks))


def check_positive(option: str, value):
    if value is not None and value <= 0:
        raise UserError(f"{option} must be a positive number, got {value}")
    return value


def resolve_sides(args):
    """(candidate Side, baseline Side | None, thresholds) from the command line and the checkpoint."""
    from lowbit.checkpoint import read
    from lowbit.evaluate import gate as gates
    from lowbit.evaluate.runner import Side
    from lowbit.models import resolve

    if args.backend == "server" and not args.url:
        raise UserError("--backend server needs --url (e.g. http://localhost:8000)")
    if args.url and args.backend != "server":
        raise UserError("--url is only used with --backend server")
    if args.gate and args.no_gate:
        raise UserError("--gate and --no-gate contradict each other")
    path = resolve(args.model)
    ckpt = read(path)
    candidate = Side(args.model, path, url=args.url)
    base_name = args.baseline or (ckpt.manifest or {}).get("source_model")
    baseline = Side(base_name, resolve(base_name)) if base_name else None
    if args.no_gate:
        thresholds = []
    elif args.gate:
        thresholds = gates.parse_spec(args.gate)
    else:
        thresholds = gates.from_recipe((ckpt.recipe or {}).get("gate") or {}, f"{path}/recipe.yaml gate")
    return candidate, baseline, thresholds


def check_gate_needs(thresholds, baseline, plan, backend: str) -> None:
    from lowbit.evaluate.gate import TEXT_METRICS

    if thresholds and baseline is None:
        raise UserError("a gate compares with a baseline: pass --baseline MODEL (or --no-gate to only score)")
    for t in thresholds:
        if backend == "server" and t.metric in ("kl", "top1"):
            raise UserError(f"gate {t} needs full next-token distributions: use --backend inproc")
        if t.metric in TEXT_METRICS and "ppl" not in plan.tasks:
            raise UserError(f"gate {t} is measured by the ppl task: add ppl to --tasks")
        task = t.metric.rsplit(".", 1)[0] if "." in t.metric else None
        if task and task not in plan.lm_tasks:
            raise UserError(f"gate {t} needs the task {task} in --tasks")
        if t.metric == "recovery" and not plan.lm_tasks:
            raise UserError(f"gate {t} needs at least one accuracy task in --tasks")
