"""quantize --layer-by-layer against the whole-model path on tiny random models: the same checkpoint (configs,
tensor names, scales to fp32 rounding, codes equal or one step apart at rounding ties), the same greedy tokens from
the engine, sharded output, and one-line refusals of what it does not do."""
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Phi3Config

import lowbit
from lowbit.calibrate.data import load_texts, token_batches
from lowbit.checkpoint import read
from lowbit.checkpoint.io import SHARD_INDEX
from lowbit.cli import main
from lowbit.errors import UserError
from lowbit.formats import unpack_e2m1, unpack_int4_rows
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.recipe import load_recipe
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.05, tie_word_embeddings=False, max_position_embeddings=256)
CALIB = dict(num_samples=6, seq_len=32)  # two chunks of BATCH_SIZE sequences, the second one short
# The two paths compute the same float forwards in the same order; what may differ is the last bit of a division
# (modelopt's fake quant and lowbit's formats order some operations differently). So: fp32 scales within 2 ulp,
# integer codes (fp8 and e4m3 as sign-magnitude, int4, e2m1) at most one step apart and only at rounding ties,
# which TIES bounds as a fraction of a tensor's elements. Measured on these models: bit-equal.
SCALE_RTOL = 2.4e-7
TIES = 1e-3
CASES = [("llama", "fp8"), ("llama", "int4_rtn"), ("phi3", "nvfp4")]


def hf_config(family: str):
    if family == "llama":
        return LlamaConfig(**SMALL)
    half = SMALL["hidden_size"] // SMALL["num_attention_heads"] // 2
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
                "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [4.0] * half}
    return Phi3Config(**SMALL, original_max_position_embeddings=128, rope_parameters=longrope, pad_token_id=0,
                      eos_token_id=2, bos_token_id=1)


def make_source(path, config, dtype=torch.bfloat16, shard="1GB"):
    """A random HF model directory (bf16 safetensors, sharded when `shard` is small) with the embedded tokenizer."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path, max_shard_size=shard)
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def pair(request, tmp_path_factory):
    family, recipe = request.param
    root = tmp_path_factory.mktemp(f"{family}-{recipe}")
    src = make_source(root / "src", hf_config(family), shard="3MB")  # a sharded bf16 source, read tensor by tensor
    out = {}
    for name, layer_by_layer in (("whole", False), ("layer", True)):
        out[name] = root / name
        lowbit.quantize(str(src), recipe=recipe, out=out[name], layer_by_layer=layer_by_layer, **CALIB)
    return out["whole"], out["layer"]


def signed_codes(t: torch.Tensor, fmt) -> torch.Tensor:
    """Integer codes in which neighbouring representable values of one sign differ by one."""
    if t.dtype == torch.float8_e4m3fn:
        bits, sign = t.view(torch.uint8).int(), 0x80
    elif fmt.kernel == "nvfp4":
        bits, sign = unpack_e2m1(t).int(), 0x8
    elif fmt.kernel == "int4":
        return unpack_int4_rows(t).int()
    else:
        raise AssertionError(f"no integer codes for {t.dtype} of {fmt}")
    return torch.where(bits & sign > 0, -(bits & (sign - 1)), bits & (sign - 1))


def assert_same_tensor(name: str, a: torch.Tensor, b: torch.Tensor, ckpt) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    if a.dtype == torch.float32 and name.rsplit(".", 1)[-1].endswith(("scale", "scale_2")):
        torch.testing.assert_close(b, a, rtol=SCALE_RTOL, atol=0, msg=name)
    elif a.dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(a, b), name  # float tensors are copied, not computed
    else:
        fmt = ckpt.layer_format(name.rsplit(".", 1)[0])
        step = (signed_codes(a, fmt) - signed_codes(b, fmt)).abs()
        assert step.max() <= 1 and (step > 0).float().mean() <= TIES, f"{name}: {(step > 0).sum()} codes differ"


def test_layer_by_layer_checkpoint_equals_the_whole_model_path(pair):
    whole, layer = pair
    a, b = read(whole), read(layer)
    assert a.quant == b.quant
    configs = [json.loads((p / "config.json").read_text()) for p in pair]
    for c in configs:
        c["quantization_config"].pop("producer")
    assert configs[0] == configs[1]
    ta, tb = a.tensors(), b.tensors()
    assert set(ta) == set(tb)
    for name in ta:
        assert_same_tensor(name, ta[name], tb[name], a)
    assert (layer / "recipe.yaml").is_file() and (layer / "tokenizer.json").is_file()
    source = read(whole.parent / "src").tensors()
    norm = "model.layers.0.input_layernorm.weight"  # nvfp4 folds its smoothing there, in both paths alike
    assert torch.equal(ta[norm], source[norm].float()) == (load_recipe(str(whole / "recipe.yaml")).smoothing is None)
    assert set(json.loads((layer / "lowbit_manifest.json").read_text())["files"]) >= {"model.safetensors",
                                                                                      "hf_quant_config.json"}


def greedy(path, ids: list[int]) -> list[int]:
    engine = Engine(path, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=16, max_batch_size=2))
    engine.add_request("0", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), stream=False)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    return done[0].outputs[0].token_ids


def test_engine_serves_it_with_the_same_greedy_tokens(pair):
    tok = read(pair[0]).path
    from transformers import AutoTokenizer

    ids = token_batches(AutoTokenizer.from_pretrained(tok), load_texts("builtin:boolq", split="heldout"), 1, 20, 1)[0]
    assert greedy(pair[1], ids) == greedy(pair[0], ids)


def test_sharded_output_holds_the_same_tensors(pair, tmp_path):
    whole, layer = pair
    sharded = tmp_path / "sharded"
    lowbit.quantize(str(whole.parent / "src"), recipe=read(layer).recipe["name"], out=sharded, layer_by_layer=True,
                    max_shard_size="4MB", **CALIB)
    files = sorted(f.name for f in sharded.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert set(json.loads((sharded / SHARD_INDEX).read_text())["weight_map"].values()) == set(files)
    ta, tb = read(layer).tensors(), read(sharded).tensors()
    assert set(ta) == set(tb)
    for k in ta:
        assert torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("recipe, why", [("int4_awq", "calibrates with awq_full"),
                                         ("w8a8_sq", "calibrates with smoothquant"),
                                         ("int4_gptq", "calibrates with awq_lite")])
def test_search_recipes_are_refused_before_loading(recipe, why, tmp_path):
    with pytest.raises(UserError, match=f"--layer-by-layer: recipe {recipe} {why}"):
        lowbit.quantize(str(tmp_path / "no-such-model"), recipe=recipe, out=tmp_path / "o", layer_by_layer=True)
    assert not (tmp_path / "o").exists()


def test_moe_model_is_refused(tmp_path):
    moe = MixtralConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1)
    src = make_source(tmp_path / "moe", moe)
    with pytest.raises(UserError, match="mixture-of-experts"):
        lowbit.quantize(str(src), recipe="fp8", out=tmp_path / "o", layer_by_layer=True, **CALIB)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "int4_awq"], "--layer-by-layer: recipe int4_awq calibrates with awq_full"),
    (["--recipe", "fp8", "--export-format", "compressed-tensors"], "writes the modelopt format only"),
    (["--recipe", "auto", "--gate", "kl<=0.1"], "--layer-by-layer does not run --recipe auto"),
])
def test_cli_refuses_with_one_line(capsys, tmp_path, argv, message):
    code = main(["quantize", "--layer-by-layer", *argv, "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


# ---- peak host memory (slow: the quantize runs in a fresh process, ~30 s of imports on a loaded 2-core machine;
# dev/bench/layerwise_peak_rss.py measures a 1.3 GB model the same way)
PEAK = dict(vocab_size=49152, hidden_size=256, intermediate_size=4096, num_hidden_layers=48, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
SLACK = 96 * 2**20  # the tokenizer, allocator arenas, the calibration text (measured growth here: 115 MiB)


@pytest.mark.slow
def test_peak_memory_is_one_layer_not_the_model(tmp_path):
    from lowbit.testing.random_model import quantize_peak, write_random_model

    size = write_random_model(tmp_path / "src", LlamaConfig(**PEAK))  # bf16 bytes on disk; float32 is twice that
    h, i = PEAK["hidden_size"], PEAK["intermediate_size"]
    layer = 2 * h * h + 2 * h * (h // 2) + 3 * h * i  # q, o; k, v (2 of 4 heads); gate, up, down
    # Held at the peak: one float32 layer, the float temporaries of quantizing its largest linear and the quantized
    # tensors (together < 3 x 4 bytes a layer parameter), the calibration activations (8 x 64 tokens, a few MiB), a
    # 32 MiB row slice of a vocabulary matrix, and SLACK. The embedding is never whole in memory: only the rows of the
    # calibration tokens are filled. The whole-model path holds the whole float32 model instead (2 x size).
    bound = 12 * layer + 32 * 2**20 + SLACK
    r = quantize_peak(tmp_path / "src", tmp_path / "out")
    growth = r["hwm"] - r["start"]
    print(f"peak RSS growth {growth / 2**20:.0f} MiB (bound {bound / 2**20:.0f}) for a model of "
          f"{size / 2**20:.0f} MiB bf16, {2 * size / 2**20:.0f} MiB float32; child ru_maxrss {r['maxrss'] / 2**20:.0f}")
    assert growth <= bound and growth <= 0.5 * size
    assert read(tmp_path / "out").quant_algo == "FP8"


def test_shard_writer_reads_back_through_safetensors(tmp_path):
    from safetensors.torch import load_file

    from lowbit.checkpoint.shard_writer import ShardWriter

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, 3, generator=g), "b": torch.tensor(0.25), "c": torch.randn(4, 8).to(torch.bfloat16),
               "d": torch.randn(6, 2).to(torch.float8_e4m3fn), "e": torch.arange(7, dtype=torch.uint8)}
    writer = ShardWriter(tmp_path, max_bytes=64)  # shards: a (60 bytes) + b (4) | c (64) | d (12) + e (7) | f (48)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.add_rows("f", (4, 3), torch.float32, [torch.ones(1, 3, dtype=torch.bfloat16), torch.zeros(3, 3)])
    files = writer.close()
    assert len(files) == 4 and files[0].name == "model-00001-of-00004.safetensors"
    back = {}
    for f in files:
        back |= load_file(f)
    assert set(back) == set(tensors) | {"f"}
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype, name
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert torch.equal(back["f"], torch.cat([torch.ones(1, 3), torch.zeros(3, 3)]))
    assert json.loads((tmp_path / SHARD_INDEX).read_text())["weight_map"]["f"] == files[3].name
