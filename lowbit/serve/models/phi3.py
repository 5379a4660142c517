"""Phi-3: the Llama blocks served from the checkpoint's fused self_attn.qkv_proj and mlp.gate_up_proj tensors (each
loaded as the merged linear it already is), LongRoPE ("longrope", "su") rotary, an optional sliding window."""
from lowbit.serve.models.llama import LlamaForCausalLM
from lowbit.serve.models.mistral import require_silu

_LONGROPE_NAMES = ("su", "yarn")  # what Phi3Config reads as longrope


def phi3_config(config: dict) -> dict:
    """The config as transformers' Phi3Config reads it: "su" and "yarn" rope types are longrope."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    if params.get("rope_type", params.get("type")) in _LONGROPE_NAMES:
        params["rope_type"] = "longrope"
        return {**config, key: params}
    return config


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: dict):
        require_silu(config)
        super().__init__(phi3_config(config))

    @property
    def attn_kwargs(self) -> dict:
        return {"sliding_window": self.config.get("sliding_window")}
