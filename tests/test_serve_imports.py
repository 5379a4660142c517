"""The engine, the Python API and the CLI module import without the HTTP stack (the GPU machine has none)."""
import subprocess
import sys

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "pydantic", "starlette", "modelopt"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
"""


def test_engine_imports_without_fastapi_pydantic_or_modelopt():
    code = BLOCK + """
import lowbit.serve, lowbit.serve.engine.engine, lowbit.serve.server.async_engine, lowbit.serve.server.cli
from lowbit.serve import LLM, SamplingParams
import lowbit.serve.models.llama, lowbit.serve.models.qwen
assert "fastapi" not in sys.modules and "pydantic" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_without_fastapi_is_a_user_error():
    code = BLOCK + """
from lowbit.cli import main
sys.exit(main(["serve", "smollm2-135m", "--port", "1"]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "pip install 'lowbit[serve]'" in r.stderr


def _serve_modules():
    import pathlib

    import lowbit.serve

    root = pathlib.Path(lowbit.serve.__file__).parent
    return sorted(root.rglob("*.py"))


def test_serve_imports_kernels_only_through_their_public_face():
    """serve/ uses `from lowbit.kernels import name` with names lowbit.kernels exports; no kernel module by path."""
    import ast

    import lowbit.kernels

    offenders = []
    for path in _serve_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.startswith("lowbit.kernels.")]
            elif isinstance(node, ast.ImportFrom) and node.module == "lowbit.kernels":
                bad = [f"lowbit.kernels.{a.name}" for a in node.names if a.name not in lowbit.kernels.__all__]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowbit.kernels."):
                bad = [node.module]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {name}" for name in bad]
    assert not offenders, offenders


def test_scheduler_block_manager_and_sequence_import_without_torch():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "triton"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
import lowbit.serve.engine.scheduler, lowbit.serve.engine.block_manager, lowbit.serve.engine.sequence
assert "torch" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)
