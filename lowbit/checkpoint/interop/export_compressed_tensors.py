"""A lowbit FP8 / FP8_PER_CHANNEL_PER_TOKEN checkpoint rewritten as compressed-tensors "float-quantized" (the
tensors, names and quantization_config llm-compressor writes for its FP8 / FP8_DYNAMIC schemes), for vLLM.

Scales stay fp32 (llm-compressor writes them in the model dtype; fp32 keeps the model bit-identical and vLLM reads
either). exclude_modules become `ignore` entries (names as they are, wildcards as `re:` patterns); FP8 KV scales
k_proj.k_scale / v_proj.v_scale become self_attn.k_scale / v_scale with a float 8-bit `kv_cache_scheme`.
"""
import fnmatch
import json
from pathlib import Path

from lowbit import formats
from lowbit.errors import UserError

FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
SCHEMES = {  # lowbit format name -> (weights, input_activations) as llm-compressor's presets write them
    formats.FP8.name: ({**FP8_ARGS, "strategy": "tensor", "dynamic": False},
                       {**FP8_ARGS, "strategy": "tensor", "dynamic": False}),
    formats.FP8_PER_CHANNEL_PER_TOKEN.name: ({**FP8_ARGS, "strategy": "channel", "dynamic": False},
                                             {**FP8_ARGS, "strategy": "token", "dynamic": True}),
}


def ignore_entry(pattern: str) -> str:
    """A modelopt exclude_modules entry -> a compressed-tensors ignore entry matching the same modules."""
    if not any(c in pattern for c in "*?["):
        return pattern
    return "re:" + fnmatch.translate(pattern).removeprefix("(?s:").removesuffix(")\\Z") + "$"


def quantization_config(quant: dict) -> dict:
    algo = quant.get("quant_algo")
    if algo not in SCHEMES:
        raise UserError(f"export to compressed-tensors: quant_algo {algo!r} is not supported "
                        f"(only {', '.join(SCHEMES)})")
    weights, inputs = SCHEMES[algo]
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                        "output_activations": None, "format": "float-quantized"}},
          "ignore": [ignore_entry(p) for p in quant.get("exclude_modules") or ()], "kv_cache_scheme": None}
    if quant.get("kv_cache_quant_algo") is not None:
        if formats.kv_format(quant["kv_cache_quant_algo"]) is not formats.KV_FP8:
            raise UserError(f"export to compressed-tensors: KV {quant['kv_cache_quant_algo']!r} is not supported")
        qc["kv_cache_scheme"] = {**FP8_ARGS, "strategy": "tensor", "dynamic": False}
    return qc


def tensors(ckpt, algo: str) -> dict:
    """The checkpoint's tensors under compressed-tensors' names and shapes."""
    out = {}
    kv_names = {v: k for k, v in formats.KV_FP8.scale_names().items()}  # "k_proj.k_scale" -> "k"
    for name, t in ckpt.tensors().items():
        module, suffix = name.rsplit(".", 1)
        tail = ".".join(name.rsplit(".", 2)[-2:])
        if tail in kv_names:
            out[f"{name.rsplit('.', 2)[0]}.{kv_names[tail]}_scale"] = t.float().reshape(1)
        elif suffix == "weight_scale":
            out[name] = t.float().reshape(1) if algo == formats.FP8.name else t.float().reshape(-1, 1)
        elif suffix == "input_scale":
            if algo == formats.FP8.name:
                out[name] = t.float().reshape(1)
        else:
            out[name] = t
    return out


def rewrite(directory: Path) -> None:
    """Rewrites the lowbit checkpoint in `directory` (a temporary export directory) in compressed-tensors layout."""
    from safetensors.torch import save_file

    from lowbit.checkpoint.io import QUANT_CONFIG, read

    ckpt = read(directory)
    if ckpt.quant is None:
        raise UserError(f"{directory}: an unquantized checkpoint has no compressed-tensors form")
    qc = quantization_config(ckpt.quant)
    converted = tensors(ckpt, ckpt.quant["quant_algo"])
    for f in ckpt.weight_files:
        f.unlink()
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        index.unlink()
    save_file({k: v.contiguous() for k, v in converted.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = dict(ckpt.config, quantization_config=qc)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / QUANT_CONFIG).unlink()


__all__ = ["rewrite", "quantization_config", "ignore_entry"]
