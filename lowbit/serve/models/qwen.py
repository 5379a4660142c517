"""Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k, no bias): Llama blocks with two switches."""
from lowbit.serve.models.llama import LlamaForCausalLM


def _refuse_sliding_window(config: dict) -> None:
    """Qwen's windowed layers (use_sliding_window, from max_window_layers on) are not built: refuse, not ignore."""
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window is not supported for Qwen2/Qwen3; supported: false")


class Qwen2ForCausalLM(LlamaForCausalLM):
    attn_kwargs = {"qkv_bias": True}

    def __init__(self, config: dict):
        _refuse_sliding_window(config)
        super().__init__(config)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attn_kwargs = {"qk_norm": True}

    def __init__(self, config: dict):
        _refuse_sliding_window(config)
        super().__init__(config)
