"""Sharded checkpoints: quantize's export forced into small shards (model-0000k-of-0000n.safetensors + index) serves
and dequantizes exactly as the same checkpoint in one file, and the lazy reader the serve loader uses holds one
tensor at a time, not the model (peak RSS measured in a child process)."""
import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import lowbit
from lowbit.calibrate.data import load_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.checkpoint import load_reference_model, read
from lowbit.checkpoint.io import SHARD_INDEX
from lowbit.errors import UserError
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model, with_calibration
from lowbit.quantize.export import export, shard_bytes
from lowbit.recipe import load_recipe
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.05, tie_word_embeddings=False, max_position_embeddings=256)
SHARD = "4MB"  # the two 12.6 MB vocabulary matrices get a shard each, the layers share the others


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(one-file checkpoint, sharded checkpoint) of the same calibrated FP8 model."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("shards")
    AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), dtype=torch.float32).save_pretrained(root / "src")
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, root / "src" / f.name)
    recipe = with_calibration(load_recipe("fp8"), num_samples=2, seq_len=32)
    model, tok = load_float_model(root / "src")
    calibrate(model, recipe, token_batches(tok, load_texts(recipe.calibration.data), 2, 32, seed=0))
    twin = copy.deepcopy(model)  # export packs the model in place
    export(model, tok, recipe, root / "whole", source="tiny", max_shard_size="1GB")
    export(twin, tok, recipe, root / "sharded", source="tiny", max_shard_size=SHARD)
    return root / "whole", root / "sharded"


def test_export_writes_shards_and_an_index(exported):
    whole, sharded = exported
    assert [f.name for f in whole.glob("*.safetensors")] == ["model.safetensors"]
    files = sorted(f.name for f in sharded.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    weight_map = json.loads((sharded / SHARD_INDEX).read_text())["weight_map"]
    assert set(weight_map.values()) == set(files)
    assert read(sharded).weight_files == [sharded / f for f in files]
    assert set(read(sharded).tensors(lazy=True)) == set(read(whole).tensors()) == set(weight_map)


def test_sharded_checkpoint_serves_and_dequantizes_identically(exported):
    whole, sharded = exported
    tok = AutoTokenizer.from_pretrained(whole)
    ids = torch.tensor([token_batches(tok, load_texts("builtin:boolq", split="heldout"), 1, 24, seed=1)[0]])
    with torch.no_grad():
        ref = [load_reference_model(p)[0](ids).logits for p in (whole, sharded)]
    assert torch.equal(ref[0], ref[1])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = []
    for p in (whole, sharded):
        e = Engine(p, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=16, max_batch_size=2))
        e.add_request("0", ids[0].tolist(), params, stream=False)
        while e.has_unfinished():
            outs += [o for o in e.step() if o.finished]
    a, b = outs
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt_logprobs == b.prompt_logprobs and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_index_naming_a_missing_shard_is_one_error(exported, tmp_path):
    _, sharded = exported
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    victim = sorted(broken.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(UserError, match=f"names shard {victim.name}"):
        read(broken).weight_files


def test_bad_shard_size_is_refused():
    assert shard_bytes("5GB") == 5 * 10**9 and shard_bytes("2GiB") == 2 * 2**30 and shard_bytes(1000) == 1000
    for bad in ("five", "0", "-3GB", "5XB"):
        with pytest.raises(UserError, match="--max-shard-size"):
            shard_bytes(bad)


# ---- peak host memory of the lazy reader
TENSORS, ROWS, COLS, SHARDS = 32, 1024, 2048, 8  # 32 x 8 MiB float32 = 256 MiB in 8 shards
TOTAL = TENSORS * ROWS * COLS * 4
# Lazy: the tensor in hand (8 MiB) and the interpreter's noise; eager: every shard's pages stay mapped.
LAZY_MAX = 0.2 * TOTAL
EAGER_MIN = 0.8 * TOTAL

PEAK = textwrap.dedent("""
    import sys, torch
    from lowbit.checkpoint import read

    def rss(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

    ckpt = read(sys.argv[1])
    ckpt.weight_files
    start = rss("VmRSS:")
    tensors = ckpt.tensors(lazy=sys.argv[2] == "lazy")
    total = 0.0
    for name in sorted(tensors):
        total += float(tensors[name].sum())  # touches every page of the tensor
    print(rss("VmHWM:") - start, total)
""")


def peak_growth(path, mode: str) -> tuple[int, float]:
    """(peak RSS growth in bytes while reading every tensor, the sum of all tensors) in a fresh process."""
    root = os.path.dirname(os.path.dirname(lowbit.__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), mode], capture_output=True, text=True, check=True,
                         env=env, timeout=120)
    grown, total = out.stdout.split()
    return int(grown), float(total)


def test_lazy_reader_holds_one_tensor_not_the_model(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    per_shard = TENSORS // SHARDS
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {f"t{s * per_shard + i}": torch.randn(ROWS, COLS, generator=gen) for i in range(per_shard)}
        save_file(part, tmp_path / name)
        weight_map |= {k: name for k in part}
    (tmp_path / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    lazy, lazy_sum = peak_growth(tmp_path, "lazy")
    eager, eager_sum = peak_growth(tmp_path, "eager")
    assert lazy_sum == eager_sum  # the same tensors were read
    assert eager >= EAGER_MIN, f"the measurement does not see the whole model: {eager / 2**20:.0f} MiB"
    print(f"peak RSS growth: lazy {lazy / 2**20:.0f} MiB, eager {eager / 2**20:.0f} MiB of {TOTAL / 2**20:.0f} MiB")
    assert lazy <= LAZY_MAX, f"lazy reading peaked at {lazy / 2**20:.0f} MiB of {TOTAL / 2**20:.0f} MiB"
