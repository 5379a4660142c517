"""Runs a script or module with Tuning fields overridden for the whole process (an A/B of a tuning value where the
engine captures its graphs under the values in force):

    python3 dev/bench/with_tuning.py '{"moe_fused_gemv_max_pairs": {"dense": 0, "fp8": 0}}' -m lowbit.cli bench serve ...
    python3 dev/bench/with_tuning.py '{...}' dev/bench/kernel_profile.py --model qwen3-30b-a3b ...

JSON objects become frozen mappings (merged into the field's current mapping) and lists tuples (the Tuning fields'
types).
"""
import json
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.kernels import tuning  # noqa: E402


def to_field(value):
    if isinstance(value, dict):
        return tuning.frozen({k: to_field(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(to_field(v) for v in value)
    return value


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    changes = {}
    for name, value in json.loads(sys.argv[1]).items():
        before = getattr(tuning.current(), name)
        if isinstance(value, dict) and hasattr(before, "items"):  # a mapping field: the keys given replace theirs
            value = {**before, **value}
        changes[name] = to_field(value)
    module = sys.argv[2] == "-m"
    target = sys.argv[3] if module else sys.argv[2]
    sys.argv = [target] + sys.argv[(4 if module else 3):]
    with tuning.override(**changes):
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
