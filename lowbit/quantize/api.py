"""`lowbit.quantize(model, recipe=..., out=...)`: load -> calibrate -> export, and a summary of what happened."""
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lowbit import models
from lowbit.recipe import Recipe, load_recipe


@dataclass
class QuantizeResult:
    out: Path
    recipe: str
    quant_algo: str
    kv_cache: str | None
    seconds: float
    size_before_mb: float
    size_after_mb: float
    quantized_layers: int
    excluded_layers: list

    def summary(self) -> str:
        return "\n".join([
            f"checkpoint   {self.out}",
            f"recipe       {self.recipe} (quant_algo {self.quant_algo}, KV cache {self.kv_cache or 'model dtype'})",
            f"time         {self.seconds:.1f} s",
            f"size         {self.size_before_mb:.1f} MB -> {self.size_after_mb:.1f} MB",
            f"layers       {self.quantized_layers} linear layers quantized, excluded: {', '.join(self.excluded_layers) or 'none'}",
        ])


def default_output(model: str, recipe: Recipe) -> Path:
    base = Path(model).name if models.is_model_dir(Path(model).expanduser()) else model.split("/")[-1]
    return models.store_path(f"{base}-{recipe.name}")


def with_calibration(recipe: Recipe, calib=None, num_samples=None, seq_len=None) -> Recipe:
    overrides = {k: v for k, v in (("data", calib), ("num_samples", num_samples), ("seq_len", seq_len)) if v is not None}
    if not overrides:
        return recipe
    from lowbit.recipe import recipe_from_dict

    return recipe_from_dict({**recipe.to_dict(), "calibration": {**dataclasses.asdict(recipe.calibration), **overrides}},
                            source=recipe.source)


def check_export_format(export_format: str, recipe: Recipe) -> None:
    """Refuses, before any calibration, an export format the recipe's scheme cannot be written in."""
    from lowbit.errors import UserError

    if export_format == "modelopt":
        return
    if export_format != "compressed-tensors":
        raise UserError(f"--export-format {export_format!r} is not one of modelopt, compressed-tensors")
    from lowbit.checkpoint.interop.export_compressed_tensors import SCHEMES

    if recipe.quant_algo not in SCHEMES:
        raise UserError(f"--export-format compressed-tensors: recipe {recipe.name} ({recipe.quant_algo}) is not "
                        f"supported (only {', '.join(SCHEMES)})")


def quantize(model: str = models.DEFAULT_MODEL, recipe="fp8", out=None, calib=None, num_samples=None, seq_len=None,
             force: bool = False, export_format: str = "modelopt",
             max_shard_size: int | str = "5GB", layer_by_layer: bool = False) -> QuantizeResult:
    """Quantize `model` (store name, local HF dir or hub id) with `recipe` (name, path or Recipe) into `out`.
    export_format: "modelopt" (hf_quant_config.json) or "compressed-tensors" (what vLLM loads).
    max_shard_size: bytes (or "5GB", "500MB") per safetensors file; a larger checkpoint is written in shards.
    layer_by_layer: calibrate and export one decoder layer at a time (lowbit.quantize.layerwise), for models larger
    than host memory; max-calibrated recipes on dense models only."""
    t0 = time.time()
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    recipe = with_calibration(recipe, calib, num_samples, seq_len)
    check_export_format(export_format, recipe)
    if layer_by_layer:
        from lowbit.quantize.layerwise import check_layerwise

        check_layerwise(recipe, export_format)
    from lowbit.quantize.export import shard_bytes

    shard_bytes(max_shard_size)  # a bad size is refused before the model loads
    out = Path(out) if out else default_output(model, recipe)
    if out.exists() and not force:
        from lowbit.errors import UserError

        raise UserError(f"output {out} already exists (use --force to overwrite)")
    from lowbit.calibrate.data import load_texts, token_batches

    texts = load_texts(recipe.calibration.data, split="calib")
    src = models.resolve(model)
    if layer_by_layer:
        from transformers import AutoTokenizer

        from lowbit.quantize.layerwise import quantize_layerwise

        tokenizer = AutoTokenizer.from_pretrained(src)
        c = recipe.calibration
        batches = token_batches(tokenizer, texts, c.num_samples, c.seq_len, c.seed)
        quantized, excluded = quantize_layerwise(src, tokenizer, recipe, batches, out, source=str(model), force=force,
                                                 max_shard_size=max_shard_size)
    else:
        quantized, excluded = quantize_whole(src, recipe, texts, out, str(model), force, export_format, max_shard_size)
    from lowbit.checkpoint import read

    written = read(out)  # the truth on disk, e.g. MIXED_PRECISION when layers got different group sizes
    return QuantizeResult(out, recipe.name, written.quant_algo, written.kv_algo, time.time() - t0,
                          dir_mb(src, "*.safetensors"), dir_mb(out, "*.safetensors"), quantized, excluded)


def quantize_whole(src: Path, recipe: Recipe, texts, out: Path, source: str, force: bool, export_format: str,
                   max_shard_size) -> tuple[int, list]:
    """The whole float model in memory: modelopt calibrates it, then exports it."""
    from lowbit.calibrate.data import token_batches
    from lowbit.calibrate.loop import calibrate
    from lowbit.quantize.export import export

    hf_model, tokenizer = load_float_model(src)
    c = recipe.calibration
    calibrate(hf_model, recipe, token_batches(tokenizer, texts, c.num_samples, c.seq_len, c.seed))
    quantized, excluded = count_layers(hf_model)
    export(hf_model, tokenizer, recipe, out, source=source, force=force, export_format=export_format,
           max_shard_size=max_shard_size)
    return quantized, excluded


def load_float_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[lowbit] loading {path}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def count_layers(model) -> tuple[int, list]:
    """(number of linears whose weight quantizer is on, names of linears left in float)."""
    import torch

    quantized, excluded = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        wq = getattr(module, "weight_quantizer", None)
        if wq is not None and wq.is_enabled:
            quantized += 1
        else:
            excluded.append(name)
    return quantized, excluded


def dir_mb(path: Path, pattern: str) -> float:
    return sum(f.stat().st_size for f in Path(path).glob(pattern)) / 2**20
