"""Contract 1: a recipe says what to quantize and how. One flat YAML file -> a frozen, validated dataclass."""
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lowbit.errors import UserError

RECIPE_DIR = Path(__file__).parent / "recipes"
ALGORITHMS = ("max", "mse", "awq_lite", "awq_clip", "awq_full", "smoothquant", "rtn")
ROUNDINGS = ("nearest", "gptq")  # how weights meet their calibrated scales (calibrate/gptq.py)
# NVFP4 block scales chosen by weight / output-weighted rounding error (calibrate/nvfp4_clip.py)
WEIGHT_SCALE_SEARCHES = ("mse", "output")
SMOOTHINGS = ("rms", "max")  # per-channel input statistic of the smoothing fold (calibrate/smooth.py)
ROTATIONS = ("hadamard",)  # residual-stream rotation folded into the float weights before calibration (calibrate/rotate.py)


@dataclass(frozen=True)
class Calibration:
    data: str = "builtin:boolq"  # builtin:boolq | builtin:lambada | a .jsonl/.txt file | a datasets id
    num_samples: int = 64  # sequences of seq_len tokens
    seq_len: int = 512
    seed: int = 0


@dataclass(frozen=True)
class Recipe:
    name: str
    quant_algo: str  # the checkpoint's quant_algo, FORMATS.md
    description: str = ""
    kv_cache: str | None = None  # a kv_cache_quant_algo: calibrated k_scale/v_scale for every layer
    kv_scale_search: bool = False  # k/v amax x a multiplier chosen on calibration NLL (calibrate/kv.py)
    algorithm: str = "max"  # calibration algorithm
    algorithm_args: dict = field(default_factory=dict)  # e.g. {alpha: 0.5} for smoothquant
    rounding: str = "nearest"  # nearest | gptq: GPTQ rounding against the calibrated scales, after `algorithm`
    rounding_args: dict = field(default_factory=dict)  # gptq: {damp: fraction of mean diag(H) added, block: columns, static_groups}
    weight_scale_search: str | None = None  # None | mse | output: NVFP4 weight block scales searched (calibrate/nvfp4_clip.py)
    smoothing: str | None = None  # None | rms | max: calibrate/smooth.py, on the float model before calibration
    smoothing_alpha: float = 0.5  # s = a^alpha / w^(1 - alpha): the share of the inputs' spread moved into the weights
    rotation: str | None = None  # None | hadamard: calibrate/rotate.py, on the float model before calibration
    rotation_args: dict = field(default_factory=dict)  # hadamard: {seed: int, heads: rotate each value head too}
    group_size: int | None = None  # block/group size of weight scales where the format has one
    exclude: tuple = ("lm_head",)  # fnmatch patterns of module names left unquantized
    calibration: Calibration = Calibration()
    gate: dict = field(default_factory=dict)  # default thresholds for `lowbit eval --gate`
    source: str = ""  # the file it was read from

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        d["exclude"] = list(self.exclude)
        return d


def available() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"recipe file {name_or_path} does not exist")
        return path
    path = RECIPE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(f"unknown recipe {name_or_path!r}; available: {', '.join(available())}")
    return path


def load_recipe(name_or_path: str) -> Recipe:
    path = recipe_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where else ""
        raise UserError(f"{path}:{line} malformed YAML: {getattr(e, 'problem', e)}") from e
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return recipe_from_dict(data, source=str(path))


def recipe_from_dict(data: dict, source: str = "<dict>") -> Recipe:
    data = dict(data)
    _check_keys(data, Recipe, source, skip={"source"})
    calib = data.pop("calibration", None) or {}
    if not isinstance(calib, dict):
        raise UserError(f"{source}: 'calibration' must be a mapping")
    _check_keys(calib, Calibration, source, prefix="calibration.")
    if "exclude" in data:
        data["exclude"] = tuple(data["exclude"] or ())
    for key in ("name", "quant_algo"):
        if key not in data:
            raise UserError(f"{source}: missing required key '{key}'")
    recipe = Recipe(**data, calibration=Calibration(**calib), source=source)
    validate(recipe)
    return recipe


def _check_keys(data: dict, cls, source: str, prefix: str = "", skip=frozenset()) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - set(skip)
    for key in data:
        if key not in known:
            raise UserError(f"{source}: unknown key '{prefix}{key}' (known: {', '.join(sorted(known))})")


def validate(r: Recipe) -> None:
    def bad(key, msg):
        raise UserError(f"{r.source}: bad value for '{key}': {msg}")

    from lowbit import formats  # the registry needs torch; importing lowbit must not (the torch-free engine parts)

    quant_algos = [f.name for f in formats.calibrated()]  # the formats lowbit quantize makes
    if r.quant_algo not in quant_algos:
        bad("quant_algo", f"{r.quant_algo!r} is not one of {', '.join(quant_algos)}")
    if r.kv_cache is not None and r.kv_cache not in formats.kv_names():
        bad("kv_cache", f"{r.kv_cache!r} is not one of {', '.join(formats.kv_names())} or null")
    if r.algorithm not in ALGORITHMS:
        bad("algorithm", f"{r.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if not isinstance(r.algorithm_args, dict):
        bad("algorithm_args", "must be a mapping")
    _check_algorithm_args(r, bad)
    if r.rounding not in ROUNDINGS:
        bad("rounding", f"{r.rounding!r} is not one of {', '.join(ROUNDINGS)}")
    _check_rounding_args(r, bad)
    if r.weight_scale_search is not None and r.weight_scale_search not in WEIGHT_SCALE_SEARCHES:
        bad("weight_scale_search",
            f"{r.weight_scale_search!r} is not one of {', '.join(WEIGHT_SCALE_SEARCHES)} or null")
    if r.weight_scale_search is not None and formats.get(r.quant_algo).kernel != "nvfp4":
        bad("weight_scale_search", f"applies to NVFP4 weights only, not {r.quant_algo}")
    _check_rotation(r, bad)
    _check_smoothing(r, bad)
    if not isinstance(r.kv_scale_search, bool):
        bad("kv_scale_search", f"{r.kv_scale_search!r} is not true or false")
    if r.kv_scale_search and r.kv_cache is None:
        bad("kv_scale_search", "needs a kv_cache format")
    if r.group_size is not None and (not isinstance(r.group_size, int) or r.group_size <= 0):
        bad("group_size", f"{r.group_size!r} is not a positive integer")
    if not all(isinstance(p, str) for p in r.exclude):
        bad("exclude", "must be a list of module-name patterns")
    c = r.calibration
    for key in ("num_samples", "seq_len"):
        value = getattr(c, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            bad(f"calibration.{key}", f"{value!r} is not a positive integer")
    if not isinstance(c.seed, int):
        bad("calibration.seed", f"{c.seed!r} is not an integer")
    if not isinstance(r.gate, dict):
        bad("gate", "must be a mapping of threshold names to numbers")


UNIT_ARGS = ("alpha", "alpha_step", "shrink_step", "min_clip_ratio")  # algorithm_args that must lie in [0, 1]
STEP_ARGS = ("alpha_step", "shrink_step")  # grid steps: 0 would make an empty or endless grid


def _check_algorithm_args(r: Recipe, bad) -> None:
    for key, value in r.algorithm_args.items():
        if key in UNIT_ARGS and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
            bad(f"algorithm_args.{key}", f"{value!r} is not a number in [0, 1]")
        if key in STEP_ARGS and value == 0:
            bad(f"algorithm_args.{key}", "0 is not a grid step (use a number in (0, 1])")
        if key == "max_tokens_per_batch" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            bad("algorithm_args.max_tokens_per_batch", f"{value!r} is not a positive integer")
        if key == "awq_lite_samples" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            bad("algorithm_args.awq_lite_samples", f"{value!r} is not a positive integer")
        if key == "joint_clip" and not isinstance(value, bool):
            bad("algorithm_args.joint_clip", f"{value!r} is not true or false")
        if key == "joint_clip_skip" and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            bad("algorithm_args.joint_clip_skip", f"{value!r} is not a list of linear names")


def _check_rounding_args(r: Recipe, bad) -> None:
    if not isinstance(r.rounding_args, dict):
        bad("rounding_args", "must be a mapping")
    for key, value in r.rounding_args.items():
        if key == "damp":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                bad("rounding_args.damp", f"{value!r} is not a number in (0, 1]")
        elif key == "block":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                bad("rounding_args.block", f"{value!r} is not a positive integer")
        elif key == "static_groups":
            if not isinstance(value, bool):
                bad("rounding_args.static_groups", f"{value!r} is not true or false")
        else:
            bad("rounding_args", f"unknown argument {key!r} (known: block, damp, static_groups)")


def _check_smoothing(r: Recipe, bad) -> None:
    if r.smoothing is not None and r.smoothing not in SMOOTHINGS:
        bad("smoothing", f"{r.smoothing!r} is not one of {', '.join(SMOOTHINGS)} or null")
    a = r.smoothing_alpha
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
        bad("smoothing_alpha", f"{a!r} is not a number in [0, 1]")


def _check_rotation(r: Recipe, bad) -> None:
    if r.rotation is not None and r.rotation not in ROTATIONS:
        bad("rotation", f"{r.rotation!r} is not one of {', '.join(ROTATIONS)} or null")
    if not isinstance(r.rotation_args, dict):
        bad("rotation_args", "must be a mapping")
    if r.rotation_args and r.rotation is None:
        bad("rotation_args", "given without a rotation")
    for key, value in r.rotation_args.items():
        if key == "seed":
            if isinstance(value, bool) or not isinstance(value, int):
                bad("rotation_args.seed", f"{value!r} is not an integer")
        elif key == "heads":
            if not isinstance(value, bool):
                bad("rotation_args.heads", f"{value!r} is not true or false")
        else:
            bad("rotation_args", f"unknown argument {key!r} (known: heads, seed)")
