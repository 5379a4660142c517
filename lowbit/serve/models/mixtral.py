"""Mixtral: Mistral's attention with a sparse MoE block on every layer (HF name block_sparse_moe; experts' linears
w1 gate, w3 up, w2 down), the top-k router weights always renormalised."""
from torch import nn

from lowbit.serve.layers.moe import SparseMoe
from lowbit.serve.models.qwen3_moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    mlp_name = "block_sparse_moe"

    @property
    def attn_kwargs(self) -> dict:
        return {"sliding_window": self.config.get("sliding_window")}

    def mlp_for(self, layer: int) -> nn.Module:
        c = self.config
        return SparseMoe(c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"],
                         renormalize=True, part_names=("w1", "w3", "w2"))
