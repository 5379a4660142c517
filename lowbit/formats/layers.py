"""Per-layer format resolution of an hf_quant_config "quantization" dict: MIXED_PRECISION, exclude_modules."""
import fnmatch

from lowbit.formats.base import Format, get

MIXED_PRECISION = "MIXED_PRECISION"  # then quantized_layers: {module name: {quant_algo: ..., group_size: ...}}


def layer_algo(quant_config: dict | None, module_name: str) -> str | None:
    """The quant_algo string of one linear module, or None when it is left in float (excluded, not listed)."""
    if not quant_config:
        return None
    algo = quant_config.get("quant_algo")
    if algo == MIXED_PRECISION:
        entry = (quant_config.get("quantized_layers") or {}).get(module_name)
        return entry["quant_algo"] if entry else None
    if any(excluded(module_name, p) for p in quant_config.get("exclude_modules") or ()):
        return None
    return algo


def layer_format(quant_config: dict | None, module_name: str) -> Format | None:
    """The Format of one linear module, or None when it is left in float; an unknown quant_algo is a ValueError."""
    algo = layer_algo(quant_config, module_name)
    return None if algo is None else get(algo)


def excluded(name: str, pattern: str) -> bool:
    """exclude_modules semantics: the module itself, anything under it, or an fnmatch wildcard match."""
    return name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatch(name, pattern)
