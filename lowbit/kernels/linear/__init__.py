"""Linear layers: the quantized and dense GEMMs / GEMVs, their activation quantization and their scratch."""
