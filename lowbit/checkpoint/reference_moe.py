"""The reference reader's quantized MoE experts: transformers' stacked experts replaced by per-expert reference linears."""
import torch
from torch import nn


class ReferenceQuantExperts(nn.Module):
    """Stands in for transformers' experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with the checkpoint's
    per-expert linears, children named as the checkpoint names them (`{e}.{gate}`, `{e}.{up}`, `{e}.{down}`), each a
    ReferenceQuantLinear: every expert's gate, up and down dequantize their weights and fake-quantize their inputs
    with their own scales, as modelopt's per-expert quantizers do."""

    def __init__(self, experts: list[nn.Module], part_names: tuple[str, str, str], act_fn):
        super().__init__()
        self.part_names, self.act_fn = part_names, act_fn
        for e, expert in enumerate(experts):
            self.add_module(str(e), expert)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H] (transformers' signature)."""
        gate, up, down = self.part_names
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            expert = getattr(self, str(e))
            token, slot = torch.where(top_k_index == e)
            x = hidden_states[token]
            h = self.act_fn(getattr(expert, gate)(x)) * getattr(expert, up)(x)
            y = getattr(expert, down)(h) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


PART_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # Qwen3-MoE / Mixtral checkpoints
# Mixtral checkpoints name the MoE block `block_sparse_moe`; transformers 5's module is `mlp` (its loader renames)
CHECKPOINT_BLOCK_NAMES = {".mlp.": ".block_sparse_moe."}


def checkpoint_names(module_name: str) -> list[str]:
    """The names a module's tensors may have in a checkpoint: its own, then the MoE block's older names."""
    return [module_name] + [module_name.replace(new, old) for new, old in CHECKPOINT_BLOCK_NAMES.items()
                            if new in module_name]


def module_keys(model: nn.Module, tensors) -> list[tuple[str, str]]:
    """(the model's key, the checkpoint's key) of every checkpoint tensor: keys under an older MoE block name are
    renamed where the model has no module of that name."""
    modules = {name for name, _ in model.named_modules()}
    pairs = []
    for key in tensors.keys():
        own = key
        for new, old in CHECKPOINT_BLOCK_NAMES.items():
            renamed = key.replace(old, new)
            if old in key and key.rpartition(".")[0] not in modules and renamed.rpartition(".")[0] in modules:
                own = renamed
        pairs.append((own, key))
    return pairs


def swap_quantized_experts(model: nn.Module, ckpt, tensors: dict, make_linear) -> None:
    """Every stacked experts module whose checkpoint holds quantized per-expert linears -> ReferenceQuantExperts.
    make_linear(name) -> the reference linear of checkpoint linear `name`."""
    for name, module in list(model.named_modules()):
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "num_experts")):
            continue
        found = [(c, p) for c in checkpoint_names(name) for p in PART_NAMES if f"{c}.0.{p[0]}.weight_scale" in tensors]
        if not found:
            continue
        ckpt_name, parts = found[0]
        experts = []
        for e in range(module.num_experts):
            expert = nn.Module()
            for part in parts:
                expert.add_module(part, make_linear(f"{ckpt_name}.{e}.{part}"))
            experts.append(expert)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ReferenceQuantExperts(experts, parts, module.act_fn))
