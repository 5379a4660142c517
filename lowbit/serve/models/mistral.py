"""Mistral: the Llama blocks with head_dim from the config and, when the config sets one, a sliding window on every
layer (each token attends to itself and the sliding_window - 1 tokens before it, as transformers masks)."""
from lowbit.serve.models.llama import LlamaForCausalLM


def require_silu(config: dict) -> None:
    """The gated MLP computes silu(gate) * up: refuse another hidden_act rather than serve wrong numbers."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; supported: ['silu']")


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: dict):
        require_silu(config)
        super().__init__(config)

    @property
    def attn_kwargs(self) -> dict:
        return {"sliding_window": self.config.get("sliding_window")}
