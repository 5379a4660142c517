"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE block (router + stacked experts) in place
of the MLP on the layers decoder_sparse_step and mlp_only_layers select; the other layers keep a dense gated MLP.
MoeDecoderLayer / MoeForCausalLM are shared with Mixtral."""
import torch
from torch import nn

from lowbit.serve.layers.blocks import GatedMLP
from lowbit.serve.layers.linear import Linear
from lowbit.serve.layers.moe import SparseMoe
from lowbit.serve.layers.norm import RMSNorm
from lowbit.serve.layers.rotary import RotaryEmbedding
from lowbit.serve.models.llama import LlamaAttention, LlamaModel
from lowbit.serve.models.mistral import require_silu
from lowbit.serve.models.qwen import _refuse_sliding_window
from lowbit.serve.runner.context import StepContext


class MoeDecoderLayer(nn.Module):
    """Pre-norm attention, then the MLP module under its HF name (`mlp`, Mixtral's `block_sparse_moe`): a
    SparseMoe or a dense GatedMLP."""

    def __init__(self, config: dict, rotary: RotaryEmbedding, mlp: nn.Module, mlp_name: str, **attn_kwargs):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, **attn_kwargs)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(self, hidden, residual, ctx: StepContext):
        """hidden [T, hidden_size], residual (None before the first layer) -> the next layer's (hidden, residual)."""
        hidden, residual = self.input_layernorm.forward_into(self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(hidden, ctx)
        mlp = getattr(self, self.mlp_name)
        if isinstance(mlp, GatedMLP):  # dense: the norm may hand gate_up_proj its FP8 input
            hidden, residual = self.post_attention_layernorm.forward_into(mlp.gate_up_proj, hidden, residual)
        else:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual


class MoeModel(nn.Module):
    def __init__(self, config: dict, make_mlp, mlp_name: str, **attn_kwargs):
        """make_mlp(layer_index) -> that layer's MLP module."""
        super().__init__()
        hidden = config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        self.rotary = RotaryEmbedding(config, head_dim, config.get("max_position_embeddings", 4096))
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(MoeDecoderLayer(config, self.rotary, make_mlp(i), mlp_name, **attn_kwargs)
                                    for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])

    forward = LlamaModel.forward  # the same embed -> layers -> norm chain


class MoeForCausalLM(nn.Module):
    """A decoder of MoeDecoderLayers; subclasses say which layers are sparse (mlp_for) and the MLP's HF name."""
    mlp_name = "mlp"
    attn_kwargs: dict = {}

    def __init__(self, config: dict):
        super().__init__()
        require_silu(config)
        self.config = config
        self.model = MoeModel(config, self.mlp_for, self.mlp_name, **self.attn_kwargs)
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)

    def mlp_for(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def num_experts(config: dict) -> int:
    """Hub configs say num_experts; transformers 5 saves it as num_local_experts."""
    return config["num_experts"] if "num_experts" in config else config["num_local_experts"]


def is_sparse_layer(config: dict, layer: int) -> bool:
    """transformers' rule: a MoE block unless the layer is in mlp_only_layers, on every decoder_sparse_step-th
    layer (1-based), when num_experts > 0."""
    step = config.get("decoder_sparse_step", 1)
    return (layer not in (config.get("mlp_only_layers") or []) and num_experts(config) > 0
            and (layer + 1) % step == 0)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attn_kwargs = {"qk_norm": True}

    def __init__(self, config: dict):
        _refuse_sliding_window(config)
        super().__init__(config)

    def mlp_for(self, layer: int) -> nn.Module:
        c = self.config
        if is_sparse_layer(c, layer):
            return SparseMoe(c["hidden_size"], c["moe_intermediate_size"], num_experts(c),
                             c["num_experts_per_tok"], c.get("norm_topk_prob", False))
        return GatedMLP(c["hidden_size"], c["intermediate_size"])
