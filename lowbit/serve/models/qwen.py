"""Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k, no bias): Llama blocks with two switches."""
from lowbit.serve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attn_kwargs = {"qkv_bias": True}


class Qwen3ForCausalLM(LlamaForCausalLM):
    attn_kwargs = {"qk_norm": True}
