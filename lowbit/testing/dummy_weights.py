"""`--load-format dummy`: a checkpoint of random weights at a real model's shapes, built on the device as it loads.

Nothing is read from disk: `DummyCheckpoint.tensors()` is a lazy mapping that draws one linear module's float
weight on the GPU (seeded by its name), quantizes it to the format with lowbit.testing.synthetic, and hands its
tensors out once each, so at most one module's source tensors exist beside the prepared model.
"""
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from lowbit import formats
from lowbit.checkpoint import Checkpoint
from lowbit.testing.synthetic import quantize_linear

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
GEMMA_3_12B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 1024, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1,
}
# per-layer norms beyond input_layernorm / post_attention_layernorm, by architecture
EXTRA_NORMS = {
    "Gemma2ForCausalLM": ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "Gemma3ForCausalLM": ("pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm",
                          "self_attn.k_norm"),
}
MISTRAL_7B = {  # Mistral-7B-Instruct-v0.3's shapes (no sliding window; v0.1's 4096-token window is sliding_window)
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 32768, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
QWEN3_30B_A3B = {  # Qwen3-30B-A3B's shapes: every layer sparse, 128 experts, top-8 renormalised
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
EXTRA_NORMS["Qwen3MoeForCausalLM"] = ("self_attn.q_norm", "self_attn.k_norm")
PRESETS = {"llama-3.1-8b": LLAMA_3_1_8B, "gemma-3-12b": GEMMA_3_12B, "mistral-7b": MISTRAL_7B,
           "qwen3-30b-a3b": QWEN3_30B_A3B}  # `lowbit bench serve --model NAME`
FORMATS = {  # name -> (quant_algo of the linears, kv_cache_quant_algo)
    "bf16": (None, None), "fp8": (formats.FP8.name, formats.KV_FP8.name), "int4_awq": (formats.W4A16_AWQ.name, None),
    "nvfp4": (formats.NVFP4.name, None), "w8a8_sq": (formats.W8A8_SQ_PER_CHANNEL.name, None),
    "int8_dynamic": (formats.INT8_PER_CHANNEL_PER_TOKEN.name, None),  # llm-compressor's W8A8 (compressed-tensors)
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # Qwen3-MoE's per-expert linears, `mlp.experts.{e}.{part}`
ROUTER = "mlp.gate"  # a sparse layer's router linear [num_experts, hidden], left 16-bit as modelopt leaves it
STD = 0.02  # HF's initializer_range: keeps 32 random layers finite and the logits spread


def dummy_checkpoint(fmt: str = "bf16", config: dict | None = None, seed: int = 0, device="cuda",
                     max_position_embeddings: int | None = None, std: float = STD,
                     layout: str | None = None) -> "DummyCheckpoint":
    """std: the linear weights' standard deviation (larger: each layer moves the logits more, for small tests).
    layout (int4_awq only): the int4 weights pass through that checkpoint layout and its reader as they load
    (lowbit.testing.dummy_layouts)."""
    if fmt not in FORMATS:
        raise ValueError(f"dummy format {fmt!r} is not one of {sorted(FORMATS)}")
    if layout is not None and fmt != "int4_awq":
        raise ValueError(f"dummy layout {layout!r} applies to int4_awq weights, not {fmt!r}")
    config = dict(config or LLAMA_3_1_8B)
    if max_position_embeddings:
        config["max_position_embeddings"] = max_position_embeddings
    algo, kv_algo = FORMATS[fmt]
    if layout is not None:
        from lowbit.testing.dummy_layouts import served_algo

        algo = served_algo(layout)
    quant = None if algo is None else {"quant_algo": algo, "kv_cache_quant_algo": kv_algo,
                                       "exclude_modules": ["lm_head", f"*.{ROUTER}"], "group_size": 128}
    return DummyCheckpoint(Path(f"dummy-{fmt}"), config, quant, None, None, seed=seed, device=torch.device(device),
                           std=std, layout=layout)


class DummyCheckpoint(Checkpoint):
    def __init__(self, path, config, quant, recipe, manifest, seed: int, device: torch.device, std: float = STD,
                 layout: str | None = None):
        super().__init__(path, config, quant, recipe, manifest)
        self.seed, self.device, self.std, self.layout = seed, device, std, layout

    def tensors(self, device: str = "cpu", lazy: bool = True) -> "LazyTensors":
        return LazyTensors(self)  # always lazy


class LazyTensors(Mapping):
    """name -> tensor on the checkpoint's device, drawn on first access (per linear module: all its tensors)."""

    def __init__(self, ckpt: DummyCheckpoint):
        self.ckpt = ckpt
        self.names = _tensor_names(ckpt)
        self._module: tuple[str, dict] | None = None

    def __len__(self):
        return len(self.names)

    def __iter__(self):
        return iter(self.names)

    def __contains__(self, name):
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        module, suffix = name.rsplit(".", 1)
        if self._module is None or self._module[0] != module:
            self._module = (module, self._draw_module(module))
        return self._module[1][suffix]

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator(self.ckpt.device).manual_seed(self.ckpt.seed * 1_000_003 + zlib.crc32(name.encode()))

    def _draw_module(self, module: str) -> dict:
        c, dev = self.ckpt.config, self.ckpt.device
        g = self._generator(module)
        if module.endswith(("norm", "layernorm")):
            dim = c["head_dim"] if module.endswith(("q_norm", "k_norm")) else c["hidden_size"]
            return {"weight": 1 + 0.1 * torch.randn(dim, generator=g, device=dev)}
        if module == "model.embed_tokens":
            return {"weight": torch.randn(c["vocab_size"], c["hidden_size"], generator=g, device=dev)}
        out_f, in_f = _linear_shape(c, module)
        std = self.ckpt.std
        w = std * torch.randn(out_f, in_f, generator=g, device=dev)
        algo = self.ckpt.layer_algo(module)
        # NVFP4: one weight_scale_2 for every layer, so q/k/v and gate/up share it as in modelopt's export
        if algo is not None and self.ckpt.layout is not None:
            from lowbit.testing.dummy_layouts import through_layout

            tensors = through_layout(self.ckpt.layout, module, w)
        else:
            tensors = {"weight": w.to(torch.bfloat16)} if algo is None else quantize_linear(algo, w, w_amax=8 * std)
        if self.ckpt.kv_format is not None and module.endswith((".k_proj", ".v_proj")):
            kind = module[-6]  # "k" or "v"
            tensors[f"{kind}_scale"] = torch.tensor(0.05 if kind == "k" else 0.01, device=dev)  # amax 22.4 / 4.5
        return tensors


def _linear_shape(c: dict, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a linear module by its HF name."""
    h, inter = c["hidden_size"], c["intermediate_size"]
    if ".experts." in module:
        inter = c["moe_intermediate_size"]
    if module.endswith("." + ROUTER):
        return c["num_experts"], h
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter), "lm_head": (c["vocab_size"], h)}
    return shapes[module.rsplit(".", 1)[-1]]


def _tensor_names(ckpt: DummyCheckpoint) -> set[str]:
    c = ckpt.config
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    suffixes = formats.get(ckpt.quant_algo).tensors.required  # what Format.quantize emits without `smooth`
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + n + ".weight" for n in EXTRA_NORMS.get(c["architectures"][0], ())}
        if _sparse(c, i):
            names |= {p + m + "." + s for m in LINEARS[:4] for s in suffixes} | {f"{p}{ROUTER}.weight"}
            names |= {f"{p}mlp.experts.{e}.{part}.{s}" for e in range(c["num_experts"]) for part in EXPERT_PARTS
                      for s in suffixes}
        else:
            names |= {p + m + "." + s for m in LINEARS for s in suffixes}
        if ckpt.kv_format is not None:
            names |= {f"{p}self_attn.{name}" for name in ckpt.kv_format.scale_names().values()}
    return names


def _sparse(c: dict, layer: int) -> bool:
    """Whether decoder layer `layer` has a MoE block (the served Qwen3-MoE's rule)."""
    from lowbit.serve.models.qwen3_moe import is_sparse_layer

    return bool(c.get("num_experts")) and is_sparse_layer(c, layer)
