"""Gemma 2 and Gemma 3 (text) as in HF transformers: (1 + weight) RMSNorms before and after attention and the MLP,
GeGLU, embeddings times sqrt(hidden), query_pre_attn_scalar, sliding-window layers by `layer_types`; Gemma 2 adds
attention and final-logit soft-capping, Gemma 3 per-head q/k norms and a rotary base per layer type.

Module names follow the HF checkpoints so weights load by name; activations are flattened [T, hidden].
Config keys that change the math and are not implemented here fail at build with a ValueError naming them.
"""
import torch
from torch import nn

from lowbit.serve.layers.activation import gated_activation
from lowbit.serve.layers.blocks import GatedMLP, SelfAttention
from lowbit.serve.layers.linear import Linear
from lowbit.serve.layers.norm import GemmaRMSNorm
from lowbit.serve.layers.rotary import RotaryEmbedding
from lowbit.serve.runner.context import StepContext

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(config: dict, pattern: int) -> list[str]:
    """Each layer's attention kind: config["layer_types"], else every `sliding_window_pattern`-th layer global (the
    configs written before transformers 5 carry only the pattern)."""
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", pattern))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != config["num_hidden_layers"]:
        raise ValueError(f"layer_types {unknown or types} not supported (one of {LAYER_TYPES} per layer)")
    return list(types)


def _check_config(config: dict, types: list[str]) -> None:
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
    if config.get("sliding_window") is None and "sliding_attention" in types:
        raise ValueError("sliding_window is missing for the sliding_attention layers")


class GemmaAttention(SelfAttention):
    def __init__(self, config: dict, rotary: RotaryEmbedding, layer_type: str, qk_norm: bool):
        hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // num_heads
        bias = config.get("attention_bias", False)
        eps = config["rms_norm_eps"]
        window = config.get("sliding_window") if layer_type == "sliding_attention" else None
        super().__init__(hidden, num_heads, config.get("num_key_value_heads") or num_heads, head_dim, rotary,
                         qkv_bias=bias, o_bias=bias, qk_norm_eps=eps if qk_norm else None, sliding_window=window,
                         logit_softcap=config.get("attn_logit_softcapping"),
                         scale=config["query_pre_attn_scalar"] ** -0.5)
        if qk_norm:  # Gemma's (1 + weight) convention on the per-head norms too
            self.q_norm, self.k_norm = GemmaRMSNorm(head_dim, eps), GemmaRMSNorm(head_dim, eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, layer_type: str, qk_norm: bool):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.self_attn = GemmaAttention(config, rotary, layer_type, qk_norm)
        act = gated_activation(config.get("hidden_activation") or config.get("hidden_act"))
        self.mlp = GatedMLP(hidden, config["intermediate_size"], act=act)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, hidden, residual, ctx: StepContext):
        """hidden [T, hidden_size], residual (None before the first layer) -> the next layer's (hidden, residual):
        residual + post_norm(block(pre_norm(residual))) for attention, then the MLP; each sum is fused into the
        norm that reads it."""
        hidden, residual = self.input_layernorm.forward_into(self.self_attn.qkv_proj, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, ctx))
        hidden, residual = self.pre_feedforward_layernorm.forward_into(self.mlp.gate_up_proj, hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: dict, types: list[str], rope_configs: dict, qk_norm: bool):
        super().__init__()
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        max_pos = config.get("max_position_embeddings", 8192)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(rope_configs[t], head_dim, max_pos) for t in sorted(set(types))})
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.embed_tokens.weight.requires_grad_(False)
        # HF multiplies by sqrt(hidden) cast to the model dtype (bf16 rounds sqrt(3840) = 61.97 to 62)
        self.register_buffer("embed_scale", torch.tensor(hidden ** 0.5), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, self.rotary[t], t, qk_norm) for t in types)
        self.norm = GemmaRMSNorm(hidden, config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        emb = self.embed_tokens(input_ids)
        hidden, residual = emb * self.embed_scale.to(emb.dtype), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class _GemmaForCausalLM(nn.Module):
    qk_norm = False
    default_pattern = 2  # every n-th layer global when the config has no layer_types

    def __init__(self, config: dict):
        super().__init__()
        types = layer_types(config, self.default_pattern)
        _check_config(config, types)
        self.config = config
        self.model = GemmaModel(config, types, {t: self.rope_config(config, t) for t in set(types)}, self.qk_norm)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        self.final_logit_softcap = config.get("final_logit_softcapping")

    @staticmethod
    def rope_config(config: dict, layer_type: str) -> dict:
        """The config RotaryEmbedding reads for one layer type."""
        return config

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> float32 logits [T, vocab], soft-capped cap * tanh(logits / cap) when configured."""
        logits = self.lm_head(hidden).float()
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(_GemmaForCausalLM):
    pass


class Gemma3ForCausalLM(_GemmaForCausalLM):
    qk_norm = True
    default_pattern = 6

    @staticmethod
    def rope_config(config: dict, layer_type: str) -> dict:
        """rope_parameters per layer type (transformers 5), else the older keys: rope_theta and rope_scaling for the
        global layers, rope_local_base_freq (unscaled) for the sliding ones."""
        params = config.get("rope_parameters") or {}
        if layer_type in params:
            return {"rope_parameters": params[layer_type]}
        if layer_type == "sliding_attention":
            return {"rope_parameters": {"rope_type": "default",
                                        "rope_theta": config.get("rope_local_base_freq", 10000.0)}}
        scaling = dict(config.get("rope_scaling") or {"rope_type": "default"})
        return {"rope_parameters": scaling | {"rope_theta": config.get("rope_theta", 1_000_000.0)}}
