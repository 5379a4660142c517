"""load_script for the lab scripts: a sibling script of dev/bench/ by path, or a packaged benchmark (lowbit.bench)."""
import functools
import importlib
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent


@functools.cache
def load_script(filename: str):
    """dev/bench/<filename> as a module, loaded once by path (not on sys.path: a script named like a PyPI package
    would shadow it), else lowbit.bench.<stem> (kernels.py, serve_bench.py, ... are packaged)."""
    path = HERE / filename
    if not path.is_file():
        return importlib.import_module(f"lowbit.bench.{Path(filename).stem}")
    spec = importlib.util.spec_from_file_location(f"lowbit_lab_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
