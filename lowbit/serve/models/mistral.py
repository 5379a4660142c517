"""Mistral: the Llama blocks with head_dim from the config and, when the config sets one, a sliding window on every
layer (each token attends to itself and the sliding_window - 1 tokens before it, as transformers masks)."""
from lowbit.serve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @property
    def attn_kwargs(self) -> dict:
        return {"sliding_window": self.config.get("sliding_window")}
