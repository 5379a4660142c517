"""Calibrated model -> checkpoint directory: modelopt's unified HF export, tokenizer, recipe.yaml, manifest."""
import io
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import yaml

from lowbit import __version__
from lowbit.checkpoint import RECIPE_FILE, write_atomically
from lowbit.checkpoint.io import write_manifest
from lowbit.recipe import Recipe


def export(model, tokenizer, recipe: Recipe, out: Path, source: str, force: bool = False,
           export_format: str = "modelopt") -> Path:
    """Write the checkpoint into a temporary directory and rename it to `out`. The model is packed in place.
    export_format "compressed-tensors": modelopt's tensors rewritten in that layout (lowbit.checkpoint.interop)."""
    from modelopt.torch.export import export_hf_checkpoint

    t0 = time.time()
    with write_atomically(out, force=force) as tmp:
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        with redirect_stdout(io.StringIO()):  # modelopt prints its config; keep stdout for the summary
            export_hf_checkpoint(model, export_dir=str(tmp))
        if export_format == "compressed-tensors":
            from lowbit.checkpoint.interop.export_compressed_tensors import rewrite

            rewrite(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        write_manifest(tmp, {"producer": f"lowbit {__version__}", "recipe": recipe.name, "source_model": source,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    print(f"[lowbit] exported to {out} in {time.time() - t0:.1f} s", file=sys.stderr)
    return Path(out)
