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
import lowbit.serve, lowbit.serve.engine, lowbit.serve.async_engine, lowbit.serve.cli
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
