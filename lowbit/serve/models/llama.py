"""Llama family (Llama 2/3, SmolLM2, Mistral-style configs) on paged attention; Qwen builds on these blocks.

Module names follow the HF checkpoints (model.layers.N.input_layernorm, ...) so weights load by name; q/k/v and
gate/up run as merged linears (self_attn.qkv_proj, mlp.gate_up_proj) loaded from their HF parts; FP8 parts with
unequal weight scales merge per-tensor and rotary_store_kv / silu_and_mul apply the deferred ratios
(layers.MergedLinear).
Activations are flattened: hidden [T, hidden_size] for the T new tokens of all sequences in the step. Where the
next linear is static FP8, the norm (or silu) before it writes its output already quantized to float8_e4m3fn.
"""
import torch
from torch import nn

from lowbit.serve.attention import Attention
from lowbit.serve.context import StepContext
from lowbit.serve.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding, SiluAndMul


class LlamaAttention(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, qkv_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = qkv_bias or config.get("attention_bias", False)
        self.sizes = [q_size, kv_size, kv_size]
        # without qk_norm, rotary_store_kv applies the merged FP8 layer's deferred scales (an RMSNorm would absorb them)
        self.qkv_proj = MergedLinear(hidden, self.sizes, qkv_bias, ["q_proj", "k_proj", "v_proj"],
                                     defer_part_scales=not qk_norm)
        self.o_proj = Linear(q_size, hidden, config.get("attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"]) if qk_norm else None
        self.rotary = [rotary]  # shared, and kept out of this module's children
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        out_scale = self.o_proj.fp8_input_scale
        if self.q_norm is None:  # rotary (with part_scales) and the K/V store straight from the qkv rows, one launch
            return self.o_proj(self.attn.forward_qkv(qkv, self.rotary[0].cos_sin_cache, self.qkv_proj.part_scales,
                                                     ctx, out_scale))
        q, k, v = qkv.split(self.sizes, dim=-1)  # Qwen3: per-head RMSNorm before RoPE
        t = hidden.shape[0]
        q = self.q_norm(q.view(t, -1, self.head_dim)).view(t, -1)
        k = self.k_norm(k.view(t, -1, self.head_dim)).view(t, -1)
        q, k = self.rotary[0](ctx.positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx, out_scale))


class LlamaMLP(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        bias = config.get("mlp_bias", False)
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias, ["gate_proj", "up_proj"],
                                         defer_part_scales=True)
        self.down_proj = Linear(inter, hidden, bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, quant_scale = self.gate_up_proj, self.down_proj.fp8_input_scale
        part_scales = gate_up.part_scales
        if gate_up.parts is None and part_scales is None and quant_scale is None:
            return self.down_proj(gate_up.merged(x, silu_mul=True))  # bf16 at one row: SiLU in the GEMV's epilogue
        up_scale = None if part_scales is None else part_scales[1]
        return self.down_proj(self.act(gate_up(x), quant_scale, up_scale))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding, **attn_kwargs):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, **attn_kwargs)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(self, hidden, residual, ctx: StepContext):
        qkv_scale = self.self_attn.qkv_proj.fp8_input_scale
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, quant_scale=qkv_scale), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, qkv_scale)
        hidden = self.self_attn(hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual, self.mlp.gate_up_proj.fp8_input_scale)
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
