"""A per-unit mix -> a MIXED_PRECISION checkpoint (modelopt's per-layer form), quantized by lowbit's formats."""
import json
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file, save_file

from lowbit import __version__
from lowbit.checkpoint import RECIPE_FILE, write_atomically
from lowbit.checkpoint.io import write_manifest
from lowbit.formats.layers import MIXED_PRECISION


def write_mixed(model, tokenizer, layer_tensors: dict, layer_entries: dict, out: Path, source: str, recipe: dict,
                force: bool = False) -> Path:
    """Writes `model` with the linears of `layer_tensors` ({name: on-disk tensors}) replaced by their quantized
    tensors; `layer_entries` ({name: {quant_algo, group_size?}}) becomes hf_quant_config's quantized_layers."""
    with write_atomically(out, force=force) as tmp:
        model.save_pretrained(tmp)  # float tensors, config, tied weights as transformers writes them
        for shard in sorted(tmp.glob("*.safetensors")):
            tensors = load_file(shard)
            for name, parts in layer_tensors.items():
                if f"{name}.weight" in tensors:
                    del tensors[f"{name}.weight"]
                    tensors.update({f"{name}.{k}": v.contiguous() for k, v in parts.items()})
            save_file(tensors, shard, metadata={"format": "pt"})
        quant = {"quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": None, "quantized_layers": layer_entries}
        (tmp / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "lowbit", "version": __version__}, "quantization": quant}, indent=2))
        tokenizer.save_pretrained(tmp)
        (tmp / RECIPE_FILE).write_text(yaml.safe_dump(recipe, sort_keys=False))
        write_manifest(tmp, {"producer": f"lowbit {__version__}", "recipe": recipe["name"], "source_model": source,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return Path(out)
