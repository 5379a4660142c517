"""Readers of foreign quantized checkpoints, selected by config.json's quantization_config.quant_method: each maps
the foreign tensors onto a registered lowbit Format's tensors (repacked once, at load)."""
from lowbit.checkpoint.interop import autoawq, compressed_tensors, gptq
from lowbit.checkpoint.interop.common import Foreign

READERS = {compressed_tensors.METHOD: compressed_tensors, autoawq.METHOD: autoawq, gptq.METHOD: gptq}


def read(path, config: dict, files: list) -> Foreign | None:
    """The Foreign view of a checkpoint whose quant_method lowbit reads; None for any other."""
    reader = READERS.get((config.get("quantization_config") or {}).get("quant_method"))
    return None if reader is None else reader.read(path, config, files)


__all__ = ["READERS", "Foreign", "read"]
