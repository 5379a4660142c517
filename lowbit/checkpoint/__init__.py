"""Contract 2, the checkpoint: config.json + hf_quant_config.json + safetensors + recipe.yaml + manifest.

The only module (with recipe.py) that the quantize half and the serve half share.
"""
from lowbit.checkpoint.io import MANIFEST, RECIPE_FILE, Checkpoint, read, write_atomically
from lowbit.checkpoint.reference import load_reference_model

__all__ = ["MANIFEST", "RECIPE_FILE", "Checkpoint", "read", "write_atomically", "load_reference_model"]
