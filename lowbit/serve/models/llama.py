"""Llama family (Llama 2/3, SmolLM2, Mistral-style configs) as in HF transformers; Qwen builds on these blocks.

Module names follow the HF checkpoints (model.layers.N.input_layernorm, ...) so weights load by name; q/k/v and
gate/up run as merged linears (self_attn.qkv_proj, mlp.gate_up_proj) loaded from their HF parts.
Activations are flattened: hidden [T, hidden_size] for the T new tokens of all sequences in the step.
"""
import torch
from torch import nn

from lowbit.serve.layers.blocks import GatedMLP, SelfAttention
from lowbit.serve.layers.linear import Linear
from lowbit.serve.layers.norm import RMSNorm
from lowbit.serve.layers.rotary import RotaryEmbedding
from lowbit.serve.runner.context import StepContext


class LlamaAttention(SelfAttention):
    def __init__(self, config: dict, rotary: RotaryEmbedding, qkv_bias: bool = False, qk_norm: bool = False,
                 sliding_window: int | None = None):
        hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
        bias = config.get("attention_bias", False)
        super().__init__(hidden, num_heads, config.get("num_key_value_heads") or num_heads,
                         config.get("head_dim") or hidden // num_heads, rotary, qkv_bias=qkv_bias or bias,
                         o_bias=bias, qk_norm_eps=config["rms_norm_eps"] if qk_norm else None,
                         sliding_window=sliding_window)


class LlamaMLP(GatedMLP):
    def __init__(self, config: dict):
        super().__init__(config["hidden_size"], config["intermediate_size"], config.get("mlp_bias", False))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, **attn_kwargs):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, **attn_kwargs)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(self, hidden, residual, ctx: StepContext):
        """hidden [T, hidden_size], residual (None before the first layer) -> the next layer's (hidden, residual)."""
        hidden, residual = self.input_layernorm.forward_into(self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(hidden, ctx)
        hidden, residual = self.post_attention_layernorm.forward_into(self.mlp.gate_up_proj, hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: dict, **attn_kwargs):
        super().__init__()
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        self.rotary = RotaryEmbedding(config, head_dim, config.get("max_position_embeddings", 4096))
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary, **attn_kwargs)
                                    for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    attn_kwargs: dict = {}

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, **self.attn_kwargs)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
