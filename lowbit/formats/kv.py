"""KV-cache formats (kv_cache_quant_algo): the cache dtype, the per-layer scale tensors and their fake quant."""
from dataclasses import dataclass

import torch

from lowbit.formats.numerics import FP8_MAX, fake_quant_fp8


@dataclass(frozen=True)
class KVFormat:
    name: str  # the kv_cache_quant_algo
    cache_dtype: torch.dtype
    max: float  # scale = amax / max
    stock: str  # modelopt's KV quantizer config (an attribute of modelopt.torch.quantization)
    k_scale: str = "k_proj.k_scale"  # fp32 scalar tensors, names under each self_attn module
    v_scale: str = "v_proj.v_scale"

    def scale_names(self) -> dict:
        return {"k": self.k_scale, "v": self.v_scale}

    def scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return amax / self.max

    def fake_quant(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x as the cache stores and returns it (quantized and dequantized with `scale`), fp32."""
        return fake_quant_fp8(x, scale)


KV_FP8 = KVFormat("FP8", torch.float8_e4m3fn, FP8_MAX, "FP8_KV_CFG")
_KV = {KV_FP8.name: KV_FP8}


def kv_format(kv_cache_quant_algo: str | None) -> KVFormat | None:
    """None for a cache in the model dtype; an unknown name is a ValueError."""
    if kv_cache_quant_algo is None:
        return None
    if kv_cache_quant_algo not in _KV:
        raise ValueError(f"kv_cache_quant_algo {kv_cache_quant_algo!r} is not supported "
                         f"(known: {', '.join(kv_names())} or none)")
    return _KV[kv_cache_quant_algo]


def kv_names() -> list[str]:
    return sorted(_KV)
