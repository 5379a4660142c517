"""House rules of the package: formats are named only by the registry, and comments carry no measurement history."""
import ast
import re
from pathlib import Path

import lowbit
from lowbit import formats

ROOT = Path(lowbit.__file__).parent
# where quant_algo names may be spelled out: the registry itself and the checkpoint reader
NAMING_FORMATS = (ROOT / "formats", ROOT / "checkpoint" / "io.py")
HISTORY = re.compile(r"\b[Rr]un [0-9]{2}\b|\b[Ss]ession\b|benchmarks\.md|kernels_notes|serve_gpu_notes"
                     r"|20[0-9]{2}-[01][0-9]-[0-3][0-9]")


def _package_files(suffix: str = "") -> list[Path]:
    return sorted(p for p in ROOT.rglob(f"*{suffix}") if p.is_file() and "__pycache__" not in p.parts)


def names_a_format(s: str) -> bool:
    """s is a quant_algo the registry knows (a name or an alias), a kv_cache_quant_algo, or MIXED_PRECISION.

    The unquantized format's lower-case spellings (bf16, fp16, none) are dtype and display words too; they pass."""
    if s in formats.kv_names() or s == formats.MIXED_PRECISION:
        return True
    try:
        fmt = formats.get(s)
    except ValueError:
        return False
    return not (fmt is formats.BF16 and s.islower())


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are module, class or function docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def format_literals(source: str, name: str = "<source>") -> list[str]:
    """'line: value' for every string constant in `source` (docstrings aside) that names a format."""
    tree = ast.parse(source, name)
    docs = _docstrings(tree)
    hits = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and names_a_format(node.value)]
    return [f"{node.lineno}: {node.value!r}" for node in sorted(hits, key=lambda n: (n.lineno, n.col_offset))]


def test_only_the_registry_and_the_checkpoint_reader_spell_out_quant_algos():
    offenders = []
    for path in _package_files(".py"):
        if any(path == p or p in path.parents for p in NAMING_FORMATS):
            continue
        offenders += [f"{path.relative_to(ROOT.parent)}:{hit}" for hit in format_literals(path.read_text(), str(path))]
    assert not offenders, "use lowbit.formats (formats.get(algo), formats.FP8.name, ...) instead:\n" + \
        "\n".join(offenders)


def test_format_literal_scan_catches_code_and_spares_docstrings():
    code = '"""Serves FP8."""\ndef f(algo):\n    """NVFP4 in prose."""\n    return algo == "W4A16_AWQ" or x == "bf16"\n'
    assert format_literals(code) == ["4: 'W4A16_AWQ'"]
    assert format_literals('KV = {"kv_cache_quant_algo": "FP8"}\nM = "MIXED_PRECISION"\nP = "BF16"') == \
        ["1: 'FP8'", "2: 'MIXED_PRECISION'", "3: 'BF16'"]


def history_mentions(text: str) -> list[str]:
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_no_measurement_history_under_lowbit():
    """Comments state invariants and reasons; runs, sessions, logs and dates belong in git and dev/."""
    offenders = []
    for path in _package_files():
        if path.suffix in (".pyc", ".so"):
            continue
        offenders += [f"{path.relative_to(ROOT.parent)}:{hit}" for hit in history_mentions(path.read_text())]
    assert not offenders, "\n".join(offenders)


def test_history_scan_catches_runs_sessions_logs_and_dates():
    for line in ("# fastest in run 47", "# measured in the fifth session", "see docs/benchmarks.md",
                 "kernels_notes says", "(serve_gpu_notes)", "# as of 2025-03-14"):
        assert history_mentions(line), line
    for line in ("# run 4 steps", "# running 16 rows", "def run_kernels(x):"):
        assert not history_mentions(line), line
