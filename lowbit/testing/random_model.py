"""A random-weight HF model directory of any size written tensor by tensor (never whole in memory), with the
embedded model's tokenizer; and the peak host memory of `quantize` on it, measured in a child process."""
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch


def write_random_model(path: Path, config, dtype=torch.bfloat16, max_shard_size: int = 2 * 10**9, seed: int = 0) -> int:
    """Writes `config`'s model with N(0, 0.02) weights (norms 1) as sharded safetensors into `path`; returns the
    bytes of tensor data."""
    from transformers import AutoModelForCausalLM

    from lowbit.checkpoint.shard_writer import ShardWriter
    from lowbit.models import DEFAULT_MODEL, resolve

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardWriter(path, max_shard_size)
    for name, t in model.state_dict().items():
        value = torch.ones(t.shape) if t.dim() == 1 else torch.randn(t.shape, generator=gen) * 0.02
        writer.add(name, value.to(dtype))
    writer.close()
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return writer.total


CHILD = textwrap.dedent("""
    import json, sys
    import lowbit
    from lowbit.quantize import layerwise  # noqa: F401 (imports outside the measured growth)
    from modelopt.torch.export import quant_utils  # noqa: F401

    def rss(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

    src, out, recipe, layer_by_layer = sys.argv[1:5]
    start = rss("VmRSS:")
    lowbit.quantize(src, recipe=recipe, out=out, layer_by_layer=layer_by_layer == "1", num_samples=8, seq_len=64)
    print(json.dumps({"start": start, "hwm": rss("VmHWM:")}))
""")


def quantize_peak(src: Path, out: Path, recipe: str = "fp8", layer_by_layer: bool = True) -> dict:
    """Quantizes `src` in a fresh process; returns {start: its RSS after imports, hwm: its peak RSS, maxrss: the
    kernel's ru_maxrss of this process's children so far} in bytes."""
    import lowbit

    root = os.path.dirname(os.path.dirname(lowbit.__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), recipe, "1" if layer_by_layer else "0"],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"quantize in a child process failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["maxrss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return result
