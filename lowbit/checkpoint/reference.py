"""The reference reader: a checkpoint -> a runnable transformers model on CPU (float32).

Quantized linears dequantize their weights once and fake-quantize activations as the format says; an FP8 KV cache
is modelled by fake-quantizing keys (after RoPE) and values with the checkpoint's k/v scales. It is the correctness
reference for lowbit's own engine and the in-process model of `lowbit eval`.
"""
import torch
from torch import nn

from lowbit import formats
from lowbit.checkpoint.io import read
from lowbit.checkpoint.reference_moe import module_keys, swap_quantized_experts

KV_ATTENTION = "lowbit_quant_kv"


class ReferenceQuantLinear(nn.Module):
    def __init__(self, fmt: formats.Format, tensors: dict, bias: torch.Tensor | None = None):
        super().__init__()
        self.format = fmt
        self.act_tensors = {k: v for k, v in tensors.items() if k in ("input_scale", "pre_quant_scale")}
        self.register_buffer("weight", fmt.dequantize(tensors))  # float32 [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.format.quantize_activation(x, self.act_tensors)
        return nn.functional.linear(xq.float(), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.format.name}, in_features={self.in_features}, out_features={self.out_features}"


def _quant_kv_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    key = module.kv_format.fake_quant(key, module.k_scale).to(query.dtype)
    value = module.kv_format.fake_quant(value, module.v_scale).to(query.dtype)
    if kwargs.get("softcap") is not None:  # SDPA has no soft-capping (Gemma 2)
        return _softcap_attention(query, key, value, attention_mask, kwargs["scaling"], kwargs["softcap"])
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _softcap_attention(query, key, value, mask, scaling, softcap):
    """transformers' eager attention with soft-capping: query [B, Hq, M, D], key / value [B, Hk, N, D], mask: SDPA's
    boolean mask [B, 1, M, N] (True: attend) or None (causal) -> ([B, M, Hq, D], None)."""
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:  # SDPA's mask functions return None where is_causal would do: the M queries end the N keys
        m, n = scores.shape[-2:]
        mask = torch.ones(m, n, dtype=torch.bool, device=scores.device).tril(n - m)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), None


def _register_kv_attention() -> None:
    """SDPA with fake-quantized K/V; masks (causal, padding, cached continuations) are built as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(KV_ATTENTION, _quant_kv_attention)
    AttentionMaskInterface.register(KV_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def load_reference_model(path, dtype=torch.float32):
    """(model, tokenizer) for a lowbit/modelopt checkpoint or a plain HF model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt = read(path)
    tokenizer = AutoTokenizer.from_pretrained(ckpt.path)
    if ckpt.quant is None:
        model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
        return model.eval(), tokenizer
    config = AutoConfig.from_pretrained(ckpt.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = ckpt.tensors()
    _swap_quantized_linears(model, ckpt, tensors)
    swap_quantized_experts(model, ckpt, tensors, lambda name: _reference_linear(ckpt, tensors, name))
    floats = {k: tensors[c].to(dtype) for k, c in module_keys(model, tensors) if not _is_quant_tensor(k, model)}
    model.load_state_dict(floats, strict=False, assign=True)
    model.tie_weights()
    _rebuild_rotary(model)
    _recreate_non_persistent_buffers(model)
    if ckpt.kv_format is not None:
        _attach_kv_scales(model, tensors, ckpt.kv_format)
    _check_materialized(model, path)
    model.eval()
    return model, tokenizer


def _swap_quantized_linears(model: nn.Module, ckpt, tensors: dict) -> None:
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        fmt = ckpt.layer_format(name)
        if fmt is None or f"{name}.weight_scale" not in tensors:
            continue
        parts = {s: tensors[f"{name}.{s}"] for s in formats.TENSOR_SUFFIXES if f"{name}.{s}" in tensors}
        bias = tensors.get(f"{name}.bias")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ReferenceQuantLinear(fmt, parts, bias))


def _reference_linear(ckpt, tensors: dict, name: str) -> ReferenceQuantLinear:
    parts = {s: tensors[f"{name}.{s}"] for s in formats.TENSOR_SUFFIXES if f"{name}.{s}" in tensors}
    return ReferenceQuantLinear(ckpt.layer_format(name), parts, tensors.get(f"{name}.bias"))


def _is_quant_tensor(key: str, model: nn.Module) -> bool:
    module_name, _, suffix = key.rpartition(".")
    if suffix in ("k_scale", "v_scale"):
        return True
    try:
        return isinstance(model.get_submodule(module_name), ReferenceQuantLinear)
    except AttributeError:
        return False


def _attach_kv_scales(model: nn.Module, tensors: dict, kv: formats.KVFormat) -> None:
    _register_kv_attention()
    for name, module in model.named_modules():
        if not name.endswith("self_attn"):
            continue
        module.kv_format = kv
        module.k_scale = tensors[f"{name}.{kv.k_scale}"].float()
        module.v_scale = tensors[f"{name}.{kv.v_scale}"].float()
    model.set_attn_implementation(KV_ATTENTION)


def _rebuild_rotary(model: nn.Module) -> None:
    """Rotary tables are non-persistent buffers computed at init: build them again off the meta device."""
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, type(module)(config=model.config))


def _recreate_non_persistent_buffers(model: nn.Module) -> None:
    """Non-persistent buffers still on the meta device (computed at init, never in a checkpoint: Gemma's embed_scale)
    are made as the model's own code makes them: allocated on the CPU, then filled by its `_init_weights` through
    transformers' initialize_weights, which leaves every tensor flagged `_is_hf_initialized` (all loaded ones) as is."""
    meta = [name for name, b in model.named_non_persistent_buffers() if b.device.type == "meta"]
    if not meta:
        return
    for t in list(model.parameters()) + list(model.buffers()):
        t._is_hf_initialized = t.device.type != "meta"
    for module in model.modules():  # from_config marked every module initialized (on the meta device)
        module._is_hf_initialized = False
    for name in meta:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent._buffers[child] = torch.empty_like(parent._buffers[child], device="cpu")
    model.initialize_weights()


def _check_materialized(model: nn.Module, path) -> None:
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{path}: checkpoint has no tensors for {missing[:5]} ({len(missing)} in all)")
