"""Calibrated model -> checkpoint directory: modelopt's unified HF export, tokenizer, recipe.yaml, manifest."""
import io
import re
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import yaml

from lowbit import __version__
from lowbit.checkpoint import RECIPE_FILE, write_atomically
from lowbit.checkpoint.io import write_manifest
from lowbit.errors import UserError
from lowbit.quantize.moe_export import fused_experts_export
from lowbit.recipe import Recipe

DEFAULT_MAX_SHARD_SIZE = "5GB"  # as HF transformers 4.x: larger checkpoints are split into shards of at most this
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def shard_bytes(value: int | str) -> int:
    """--max-shard-size as bytes: an integer or a string such as 5GB, 500MB, 2GiB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if unit not in _UNITS or int(float(m.group(1)) * _UNITS[unit]) < 1:
        raise UserError(f"--max-shard-size {value!r}: expected a positive size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def export(model, tokenizer, recipe: Recipe, out: Path, source: str, force: bool = False,
           export_format: str = "modelopt", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write the checkpoint into a temporary directory and rename it to `out`. The model is packed in place.
    export_format "compressed-tensors": o_proj smoothing first made equal within each KV group
    (lowbit.calibrate.kv_group_smooth), then modelopt's tensors rewritten in that layout (lowbit.checkpoint.interop).
    max_shard_size: a larger checkpoint is written as model-0000k-of-0000n.safetensors + model.safetensors.index.json
    (modelopt's export through transformers' save_pretrained)."""
    from modelopt.torch.export import export_hf_checkpoint

    shard_size = shard_bytes(max_shard_size)
    t0 = time.time()
    with write_atomically(out, force=force) as tmp:
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        if export_format == "compressed-tensors":
            _share_o_proj_smoothing(model)
        # modelopt prints its config: keep stdout for the summary
        with redirect_stdout(io.StringIO()), fused_experts_export(model):
            export_hf_checkpoint(model, export_dir=str(tmp), max_shard_size=shard_size)
        if export_format == "compressed-tensors":
            from lowbit.checkpoint.interop.export_compressed_tensors import rewrite

            rewrite(tmp)
        write_lowbit_files(tmp, tokenizer, recipe, source)
    print(f"[lowbit] exported to {out} in {time.time() - t0:.1f} s", file=sys.stderr)
    return Path(out)


def write_lowbit_files(tmp: Path, tokenizer, recipe: Recipe, source: str) -> None:
    """What lowbit adds beside the model files: the tokenizer, recipe.yaml and the manifest (written last: it hashes
    every file)."""
    tokenizer.save_pretrained(tmp)
    (tmp / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    write_manifest(tmp, {"producer": f"lowbit {__version__}", "recipe": recipe.name, "source_model": source,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _share_o_proj_smoothing(model) -> None:
    from lowbit.calibrate.kv_group_smooth import share_o_proj_smoothing

    changed = share_o_proj_smoothing(model)
    if changed:
        print(f"[lowbit] {len(changed)} o_proj re-smoothed with one scale per KV group (compressed-tensors has no "
              "pre_quant_scale; it folds into v_proj)", file=sys.stderr)
