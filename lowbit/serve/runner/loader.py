"""Builds a served model from a checkpoint: architecture by name, linears by quant_algo, weights by HF name."""
import torch

from lowbit import formats
from lowbit.checkpoint import Checkpoint
from lowbit.serve.layers.attention import Attention
from lowbit.serve.layers.linear import Linear, MergedLinear
from lowbit.serve.layers.moe import MoeExperts
from lowbit.serve.models import model_class

LINEAR_SUFFIXES = formats.TENSOR_SUFFIXES + ("bias",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(ckpt: Checkpoint, name: str) -> torch.dtype:
    if name == "auto":
        name = ckpt.config.get("dtype") or ckpt.config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, tp=None):
    """tp: this process's TensorParallelGroup; the model is then its rank's shard (lowbit.serve.distributed)."""
    if tp is None:
        model = model_class(ckpt.config)(ckpt.config).to(device)
    else:
        from lowbit.serve.distributed import model as tp_model
        from lowbit.serve.distributed.sharding import local_config

        model = model_class(ckpt.config)(local_config(ckpt.config, tp.shard.world))
        tp_model.parallelize(model, tp, ckpt.config)
        model = model.to(device)
    tensors = ckpt.tensors(lazy=True)  # one tensor read at a time, shard by shard
    for name, param in model.named_parameters():
        if name not in tensors:
            raise ValueError(f"{ckpt.path}: tensor {name} is missing")
        param.data = (tensors[name] if tp is None else tp_model.shard_param(tp, name, tensors[name])).to(device, dtype)
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            _load_merged(ckpt, tensors, name, module, device, dtype, tp)
        elif isinstance(module, Linear) and not name.endswith(".merged"):  # a merged one is its parent's
            _load_linear(ckpt, tensors, name, module, device, dtype, tp)
        elif isinstance(module, MoeExperts):
            _load_experts(ckpt, tensors, name, module, device, dtype, tp)
        elif isinstance(module, Attention) and ckpt.kv_format is not None:  # scales serve a quantized cache only
            _load_kv_scales(tensors, name.rsplit(".", 1)[0], module, ckpt.kv_format, device)
    return model.eval()


def kv_window(model) -> int | None:
    """Tokens behind the newest query that any attention layer still reads: the largest sliding window over the
    model's layers, or None when some layer (or every one) attends to the whole context. Blocks wholly before it
    can be freed (BlockManager's sliding_window)."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def _linear_tensors(ckpt, tensors, name, tp=None) -> tuple[str | None, dict]:
    """(quant_algo, {suffix: tensor}) of the checkpoint linear `name` (with tp: this rank's slices)."""
    found = {s: tensors[f"{name}.{s}"] for s in LINEAR_SUFFIXES if f"{name}.{s}" in tensors}
    if name == "lm_head" and not found and ckpt.config.get("tie_word_embeddings"):
        found = {"weight": tensors["model.embed_tokens.weight"]}
    if "weight" not in found:
        raise ValueError(f"{ckpt.path}: tensor {name}.weight is missing")
    algo = ckpt.layer_algo(name)
    if algo is None and found["weight"].dtype not in DTYPES.values():
        raise ValueError(f"{ckpt.path}: {name}.weight is {found['weight'].dtype} but the layer is not quantized")
    if tp is not None:
        from lowbit.serve.distributed.model import shard_linear_tensors

        found = shard_linear_tensors(tp, ckpt.config, name, algo, found)
    return algo, found


def _load_linear(ckpt, tensors, name, module: Linear, device, dtype, tp=None) -> None:
    module.load(*_linear_tensors(ckpt, tensors, name, tp), device, dtype)


def _load_merged(ckpt, tensors, name, module: MergedLinear, device, dtype, tp=None) -> None:
    """The HF parts of a merged linear (self_attn.q_proj, ... for self_attn.qkv_proj), read and merged on the device;
    a checkpoint that stores the linear fused (Phi-3's qkv_proj, gate_up_proj) loads as it is."""
    if f"{name}.weight" in tensors:
        if tp is not None:
            raise ValueError(f"{ckpt.path}: tensor parallelism does not split the fused tensor {name}.weight")
        _load_linear(ckpt, tensors, name, module.merged, device, dtype)
        return
    parent = name.rsplit(".", 1)[0]
    parts = [_linear_tensors(ckpt, tensors, f"{parent}.{part}", tp) for part in module.part_names]
    algos = [algo for algo, _ in parts]
    found = [{s: t.to(device) for s, t in part.items()} for _, part in parts]
    module.load(algos, found, device, dtype)


def _load_experts(ckpt, tensors, name, module: MoeExperts, device, dtype, tp=None) -> None:
    """Stacked expert weights from transformers' fused `{name}.gate_up_proj` [E, 2I, H] / `{name}.down_proj`
    [E, H, I], or from the per-expert linears `{name}.{e}.{part}.*` (16-bit, or one quantized format that
    MoeExperts.load_quantized takes)."""
    if tp is not None:
        raise ValueError(f"{ckpt.path}: tensor parallelism does not split the experts of {name}")
    if f"{name}.gate_up_proj" in tensors:
        module.load(tensors[f"{name}.gate_up_proj"], tensors[f"{name}.down_proj"], device, dtype)
        return
    names = [[f"{name}.{e}.{part}" for part in module.part_names] for e in range(module.num_experts)]
    parts = [[_linear_tensors(ckpt, tensors, n) for n in expert] for expert in names]
    algos = {algo for expert in parts for algo, _ in expert}
    if algos != {None}:
        if len(algos) > 1:
            raise ValueError(f"{ckpt.path}: the experts of {name} mix quantization formats "
                             f"({sorted(str(a) for a in algos)})")
        module.load_quantized(formats.get(algos.pop()), [[t for _, t in expert] for expert in parts], device,
                              f"{ckpt.path}: {name}")
        return
    w13 = [torch.cat([gate["weight"], up["weight"]]).to(device) for (_, gate), (_, up), _ in parts]
    w2 = [down["weight"].to(device) for _, _, (_, down) in parts]
    module.load(torch.stack(w13), torch.stack(w2), device, dtype)


def _load_kv_scales(tensors, self_attn: str, module: Attention, kv: formats.KVFormat, device) -> None:
    """modelopt: the KV format's names (self_attn.k_proj.k_scale); compressed-tensors / vLLM: self_attn.k_scale.
    Missing means 1.0."""
    for kind, modelopt_name in kv.scale_names().items():
        for key in (f"{self_attn}.{modelopt_name}", f"{self_attn}.{kind}_scale"):
            if key in tensors:
                setattr(module, f"{kind}_scale", tensors[key].float().reshape(()).to(device))
                break
