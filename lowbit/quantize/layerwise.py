"""`quantize --layer-by-layer`: max calibration and export one decoder layer at a time, so host memory holds one
float layer, the calibration activations and one tensor being copied, never the whole float model.

The model is built on the meta device; the source safetensors are read tensor by tensor. The calibration batches
run through the embedding (the model's own forward, stopped at layer 0, gives each layer's inputs: hidden states,
rotary embeddings, mask); then each layer is materialized from the files, run in float on the current hidden states
while its linears' input amax and its k/v amax are recorded, its linears are quantized by the format registry and
written to the output shards, and its output becomes the next layer's input. As in whole-model max calibration the
calibration forwards are unquantized, so the checkpoint is the one `quantize` writes through modelopt.
"""
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lowbit import __version__, formats
from lowbit.calibrate.groups import _excluded, layer_group
from lowbit.calibrate.layer_amax import record
from lowbit.calibrate.loop import BATCH_SIZE
from lowbit.calibrate.nvfp4_clip import search_clamp
from lowbit.errors import UserError
from lowbit.progress import Progress
from lowbit.recipe import Recipe

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # config keys of mixture-of-experts models


def check_layerwise(recipe: Recipe, export_format: str) -> None:
    """Refuses, before anything loads, what layer by layer does not do (one line saying why)."""
    fmt = formats.get(recipe.quant_algo)
    why = None
    if export_format != "modelopt":
        why = f"writes the modelopt format only, not {export_format}"
    elif recipe.algorithm not in ("max", "rtn"):
        why = f"calibrates with {recipe.algorithm}, a scale search that is not implemented layer by layer"
    elif fmt.calibration is None or fmt.calibration.modelopt_layer_format is None:
        why = f"makes {recipe.quant_algo}, which is not made layer by layer"
    elif recipe.rounding != "nearest":
        why = f"rounds with {recipe.rounding}, which is not implemented layer by layer"
    elif recipe.rotation:
        why = f"folds a {recipe.rotation} rotation into the whole model first"
    elif recipe.kv_scale_search:
        why = "searches k/v scales on the whole model's loss"
    elif not _excluded("lm_head", recipe.exclude):
        why = "quantizes lm_head (layer by layer keeps it in float: add it to exclude)"
    if why:
        raise UserError(f"--layer-by-layer: recipe {recipe.name} {why}; layer by layer runs max-calibrated recipes "
                        "such as fp8, fp8_dynamic, int4_rtn and nvfp4")


def quantize_layerwise(src: Path, tokenizer, recipe: Recipe, batches: list[list[int]], out: Path, source: str,
                       force: bool, max_shard_size) -> tuple[int, list]:
    """Writes the checkpoint of `src` (a local HF directory) quantized with `recipe` into `out` (a temporary
    directory renamed at the end); returns (number of quantized linears, names of linears left in float)."""
    from lowbit.checkpoint import read, write_atomically
    from lowbit.checkpoint.shard_writer import ShardWriter
    from lowbit.quantize.export import shard_bytes, write_lowbit_files

    tensors = read(src).tensors(lazy=True)
    model = meta_model(src)
    base = model.base_model_prefix
    layers = getattr(model, base).layers
    t0 = time.time()
    with write_atomically(out, force=force) as tmp:
        writer = ShardWriter(tmp, shard_bytes(max_shard_size))
        for name in tensors:  # embeddings, final norm, lm_head: float32, as the whole-model path writes them
            if not name.startswith(f"{base}.layers."):
                writer.add_rows(name, tensors.shape(name), torch.float32, tensors.row_chunks(name))
        hidden, calls = layer_inputs(model, tensors, batches)
        unfolded = list(hidden) if recipe.smoothing else None  # the float model's own hidden states, before any fold
        # modelopt lists the modules it gave quantizers (exactly nn.Linear and nn.Embedding, not subclasses)
        entries = {f"{n}.quantization": None for n, m in model.named_modules()
                   if type(m) in (nn.Linear, nn.Embedding) and not n.startswith(f"{base}.layers.")}
        with Progress(len(layers), f"layer by layer {recipe.name}", "layers") as bar:
            for i, layer in enumerate(layers):
                prefix = f"{base}.layers.{i}"
                materialize(model, layer, tensors, prefix)
                if recipe.smoothing:
                    unfolded = smooth_layer(layer, model.config, recipe, unfolded, calls[i])
                with record(layer, model.config, kv=recipe.kv_cache is not None,
                            squares=recipe.weight_scale_search == "output") as stats, torch.no_grad():
                    hidden = [_hidden(layer(h, *args, **kwargs)) for h, (args, kwargs) in zip(hidden, calls[i])]
                entries |= write_layer(writer, layer, prefix, stats, recipe)
                layer.to_empty(device="meta")
                release_free_memory()
                bar.update()
        writer.close()
        write_configs(tmp, src, model, recipe, entries)
        write_lowbit_files(tmp, tokenizer, recipe, source)
    print(f"[lowbit] quantized layer by layer into {out} in {time.time() - t0:.1f} s", file=sys.stderr)
    quantized = {k.removesuffix(".quantization") for k, v in entries.items() if k.endswith(".quantization") and v}
    excluded = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized]
    return len(quantized), excluded


@torch.no_grad()
def smooth_layer(layer: nn.Module, config, recipe: Recipe, unfolded: list, calls: list) -> list:
    """Folds the recipe's smoothing into `layer` from its inputs in the unfolded float model, as the whole-model path
    records them before folding any layer; returns the layer's unfolded outputs (the next layer's such inputs)."""
    from lowbit.calibrate.smooth import recording, smooth_layers

    with recording([layer], config) as stats:
        out = [_hidden(layer(h, *args, **kwargs)) for h, (args, kwargs) in zip(unfolded, calls)]
    smooth_layers([layer], config, stats, recipe.smoothing_alpha, recipe.smoothing)
    return out


def release_free_memory() -> None:
    """Hands the allocator's free pages back to the OS (glibc's malloc_trim): the freed layer's tensors under glibc's
    mmap threshold (up to 32 MiB) live on the heap, and the next layer's do not always fit in their holes."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def meta_model(src: Path):
    """The float32 model of `src` on the meta device (no memory), after refusing mixture-of-experts models."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    moe = [k for k in MOE_KEYS if getattr(config, k, None)]
    if moe:
        raise UserError(f"--layer-by-layer: {src} is a mixture-of-experts model ({moe[0]}={getattr(config, moe[0])});"
                        " layer by layer quantizes dense decoder layers only")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if not hasattr(getattr(model, model.base_model_prefix), "layers"):
        raise UserError(f"--layer-by-layer: {type(model).__name__} has no decoder-layer list to walk")
    return model.eval()


def materialize(model, module: nn.Module, tensors, prefix: str, rows: torch.Tensor | None = None) -> None:
    """Allocates `module` on the CPU in float32 and fills it: persistent tensors from the files, the rest (rotary
    frequencies) as transformers initializes them. rows: fill only these rows of its matrices (an embedding needs
    the calibration tokens' rows; the pages of the others are never touched, so never resident)."""
    module.to_empty(device="cpu")
    for sub in module.modules():
        if sub._non_persistent_buffers_set:
            model._init_weights(sub)
    with torch.no_grad():
        for key, dst in module.state_dict().items():
            name = f"{prefix}.{key}"
            if name not in tensors:
                raise UserError(f"--layer-by-layer: the source model has no tensor {name}")
            if dst.dim() < 2:
                dst.copy_(tensors[name])
                continue
            start = 0
            for chunk in tensors.row_chunks(name):  # a vocabulary matrix is never in memory twice
                if rows is None:
                    dst[start:start + len(chunk)].copy_(chunk)
                else:
                    sel = rows[(rows >= start) & (rows < start + len(chunk))]
                    dst[sel] = chunk[sel - start].to(dst.dtype)
                start += len(chunk)


class _Caught(Exception):
    """Raised by the last layer's stand-in: the model's forward has handed every layer its arguments."""


def layer_inputs(model, tensors, batches: list[list[int]]) -> tuple[list, list[list[tuple]]]:
    """(the hidden states entering layer 0, one per calibration chunk of BATCH_SIZE sequences; per layer, the other
    (args, kwargs) the model's forward passes it per chunk: rotary embeddings, the mask of its attention type).
    The model's own forward runs with each layer replaced by a stand-in that records its arguments."""
    base = model.base_model_prefix
    body = getattr(model, base)
    layers = body.layers
    tokens = torch.tensor(batches).unique()
    for name, child in body.named_children():
        if child is not layers:
            embedding = child is model.get_input_embeddings()
            materialize(model, child, tensors, f"{base}.{name}", rows=tokens if embedding else None)
    hidden, calls = [], [[] for _ in layers]

    def stand_in(i: int):
        def forward(h, *args, **kwargs):
            if i == 0:
                hidden.append(h)
            calls[i].append((args, kwargs))
            if i == len(layers) - 1:
                raise _Caught
            return h
        return forward

    for i, layer in enumerate(layers):
        layer.forward = stand_in(i)
    try:
        with torch.no_grad():
            for i in range(0, len(batches), BATCH_SIZE):
                try:
                    body(torch.tensor(batches[i:i + BATCH_SIZE]), use_cache=False)
                except _Caught:
                    pass  # every layer's arguments are recorded; the final norm need not run
    finally:
        for layer in layers:
            del layer.forward
    for child in body.children():
        if child is not layers:
            child.to_empty(device="meta")  # the embedding is done with
    return hidden, calls


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def write_layer(writer, layer: nn.Module, prefix: str, stats, recipe: Recipe) -> dict:
    """Quantizes the layer's linears and writes them, its other tensors (float32) and its k/v scales; returns
    modelopt's layer_config_dict entries of its linears."""
    fmt = formats.get(recipe.quant_algo)
    calib = fmt.calibration
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    quantized = {n: m for n, m in linears.items() if not _excluded(f"{prefix}.{n}", recipe.exclude)}
    missing = [n for n in quantized if n not in stats.inputs]
    if missing:
        raise RuntimeError(f"{prefix}.{missing[0]} saw no calibration input")
    w_amax = {}  # NVFP4's weight_scale_2 comes from the largest weight amax among linears sharing an input
    for n, m in quantized.items():
        lead = stats.shared[n]
        w_amax[lead] = max(w_amax.get(lead, 0.0), m.weight.detach().abs().amax().item())
    entries = {}
    for n, m in linears.items():
        full = f"{prefix}.{n}"
        if n not in quantized:
            entries[f"{full}.quantization"] = None
            continue
        group = layer_group(m.in_features, recipe.group_size) if calib.group_required else (calib.block or 0)
        w = m.weight.detach()
        if recipe.weight_scale_search:  # NVFP4: block scales searched, with the shared weight_scale_2 fixed
            squares = stats.squares[n] if recipe.weight_scale_search == "output" else None
            w = search_clamp(w, torch.tensor(w_amax[stats.shared[n]]), squares)
        t = fmt.quantize(w, group=group or 128, x_amax=stats.inputs[n].item(), w_amax=w_amax[stats.shared[n]])
        for suffix, value in t.items():
            writer.add(f"{full}.{suffix}", value)
        entries |= {f"{full}.quantization": calib.modelopt_layer_format, f"{full}.awq_block_size": group}
    packed = {f"{n}.weight" for n in quantized}
    for key, value in layer.state_dict().items():
        if key not in packed:
            writer.add(f"{prefix}.{key}", value)
    kv = formats.kv_format(recipe.kv_cache)
    if kv is not None:
        if not stats.k:
            raise RuntimeError(f"{prefix}: no attention module recorded k/v amax")
        for name in stats.k:  # scales named as modelopt names them, k_proj.k_scale even where q/k/v are fused
            for which, amax in (("k", stats.k), ("v", stats.v)):
                if not amax[name] > 0:
                    raise RuntimeError(f"{prefix}.{name}: {which} cache amax is {amax[name].item()}")
                writer.add(f"{prefix}.{name}.{kv.scale_names()[which]}", kv.scale_from_amax(amax[name]))
    return entries


def write_configs(tmp: Path, src: Path, model, recipe: Recipe, entries: dict) -> None:
    """config.json (with quantization_config), hf_quant_config.json and generation_config.json, built by
    modelopt's own per-layer config functions from `entries`, as its export writes them."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import process_layer_quant_config

    quant = process_layer_quant_config(entries)
    quant["kv_cache_quant_algo"] = recipe.kv_cache
    hf_quant = {"producer": {"name": "lowbit", "version": __version__}, "quantization": quant}
    (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
    model.config.architectures = model.config.architectures or [type(model).__name__]
    model.config.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = convert_hf_quant_config_format(hf_quant)
    (tmp / "config.json").write_text(json.dumps(config, indent=4))
    if (Path(src) / "generation_config.json").is_file():
        shutil.copy(Path(src) / "generation_config.json", tmp / "generation_config.json")
