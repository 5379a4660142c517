"""Foreign checkpoints for the interop tests, on a tiny random Llama: compressed-tensors ones written by the
compressed-tensors library itself; AutoAWQ GEMM and GPTQ ones packed by their documented conventions (their writers
need CUDA builds), written out independently of lowbit's readers."""
import json
import shutil

import torch

from lowbit.models import DEFAULT_MODEL, resolve

SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def tiny_llama(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**SMALL)
    config.architectures = ["LlamaForCausalLM"]
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def copy_tokenizer(out) -> None:
    for f in resolve(DEFAULT_MODEL).glob("tokenizer*"):
        shutil.copy(f, out / f.name)


# ---- compressed-tensors, by the library
def _observe(w: torch.Tensor, args):
    """(min, max) of w reduced as the weight strategy says (tensor, channel, group / tensor_group)."""
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    g = w.reshape(w.shape[0], -1, args.group_size)
    return g.amin(2), g.amax(2)


def _calibrate(module, scheme, input_amax: float) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w = module.weight.data
    args = scheme.weights
    global_scale = None
    if hasattr(module, "weight_global_scale"):
        global_scale = generate_gparam(w.amin(), w.amax()).reshape(1)
        module.weight_global_scale.data.copy_(global_scale)
    lo, hi = _observe(w, args)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    if hasattr(module, "input_global_scale"):
        module.input_global_scale.data.copy_(generate_gparam(torch.tensor(-input_amax), torch.tensor(input_amax)))
    if hasattr(module, "input_scale"):
        lo, hi = torch.tensor([-input_amax]), torch.tensor([input_amax])
        module.input_scale.data.copy_(calculate_qparams(lo, hi, scheme.input_activations)[0].reshape(-1))


def compressed_tensors_checkpoint(out, preset: str, ignore=("lm_head",),
                                  input_amax: float = 8.0, seed: int = 0, group: int = 32):
    """Writes a tiny Llama quantized with compressed-tensors' preset scheme `preset` (W4A16, W4A16_ASYM, FP8,
    FP8_DYNAMIC, NVFP4, NVFP4A16, ...) to `out`; returns the float model the weights came from."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)

    # static per-tensor int8 activations with channel int8 weights (no preset: llm-compressor's W8A8 is dynamic)
    int8 = dict(num_bits=8, type="int", symmetric=True)
    W8A8_STATIC = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**int8, strategy="channel"),
                                     input_activations=QuantizationArgs(**int8, strategy="tensor", dynamic=False))

    model = tiny_llama(seed)
    scheme = W8A8_STATIC if preset == "W8A8_STATIC" else preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.group_size and scheme.weights.group_size > 16:  # the presets' 128 exceeds the tiny model
        scheme.weights.group_size = group
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if isinstance(module, torch.nn.Linear) and scheme is not None:
                _calibrate(module, scheme, input_amax)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    copy_tokenizer(out)
    return json.loads((out / "config.json").read_text())["quantization_config"]


def add_ct_kv_scales(out, k_scale: float = 0.02, v_scale: float = 0.03) -> None:
    """The FP8 KV cache as compressed-tensors writes it (self_attn.k_scale / v_scale, kv_cache_scheme), added by hand:
    compressed-tensors 0.20 attaches KV observers only through llm-compressor's attention hooks."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    for layer in range(SMALL["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([k_scale])
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (out / "config.json").write_text(json.dumps(config))


def ct_decompress(qc: dict, tensors: dict, module: str) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's tensors -> its float weight."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    local = {k[len(module) + 1:]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    return compressor.decompress(local, scheme)["weight"]


# ---- AutoAWQ GEMM and GPTQ, by their packing conventions (AutoAWQ's WQLinear_GEMM.from_linear, auto-gptq's
# QuantLinear.pack), written out here independently of lowbit's readers
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word slot i holds column 8c + AWQ_PACK_ORDER[i]


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """int64 [..., 8] nibbles, slot i at bits 4*i -> int32 [...] (two's complement)."""
    w = sum(nibbles[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def random_int4(inp: int, out: int, group: int, seed: int, symmetric: bool = False):
    """(q uint [in, out] in [0, 15], zeros [groups, out], fp16 scales [groups, out]) as AutoAWQ / GPTQ hold them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (inp, out), generator=g)
    zeros = torch.full((inp // group, out), 8) if symmetric else torch.randint(0, 16, (inp // group, out), generator=g)
    scales = (torch.rand(inp // group, out, generator=g) * 0.02 + 0.005).half()
    return q, zeros, scales


def awq_pack(q: torch.Tensor, zeros: torch.Tensor) -> tuple:
    """AutoAWQ GEMM: qweight [in, out/8], qzeros [groups, out/8], columns interleaved by AWQ_PACK_ORDER."""
    def pack(t):
        t = t.reshape(t.shape[0], -1, 8)
        return _words(torch.stack([t[:, :, AWQ_PACK_ORDER[i]] for i in range(8)], dim=-1))
    return pack(q), pack(zeros)


def gptq_pack(q: torch.Tensor, zeros: torch.Tensor, v1: bool = True) -> tuple:
    """GPTQ: qweight [in/8, out] packed along the input rows; qzeros [groups, out/8] along the columns, each stored
    minus 1 in checkpoint_format "gptq" (v1), masked to 4 bits."""
    qweight = _words(q.reshape(-1, 8, q.shape[1]).permute(0, 2, 1))
    z = (zeros - 1) & 0xF if v1 else zeros
    return qweight, _words(z.reshape(z.shape[0], -1, 8))


def int4_reference(q, zeros, scales, g_idx) -> torch.Tensor:
    """w [out, in] = (q - z[g_idx]) * s[g_idx], fp32 (AutoAWQ's and GPTQ's dequantization formula)."""
    return ((q.float() - zeros[g_idx].float()) * scales[g_idx].float()).t()


def int4_checkpoint(out, method: str, group: int = 32, sym: bool = False, act_order: bool = False, seed: int = 0):
    """A tiny Llama whose linears are AutoAWQ GEMM (method "awq") or GPTQ v1 ("gptq") tensors; returns
    {module: reference fp32 weight} and writes the float model with those weights to out/"float"."""
    from safetensors.torch import load_file, save_file

    model = tiny_llama(seed)
    model.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    reference = {}
    for i, name in enumerate(f"model.layers.{n}.{m}" for n in range(SMALL["num_hidden_layers"]) for m in LINEARS):
        n_out, n_in = tensors.pop(f"{name}.weight").shape
        q, zeros, scales = random_int4(n_in, n_out, group, seed=100 + i, symmetric=sym)
        if method == "gptq":
            zeros = zeros.clamp(min=1)  # v1 stores zero - 1 in 4 bits: a zero of 0 reads back as 16 (auto-gptq too)
        g_idx = torch.arange(n_in) // group
        if act_order:
            g_idx = g_idx[torch.randperm(n_in, generator=torch.Generator().manual_seed(i))]
        reference[name] = int4_reference(q, zeros, scales, g_idx)
        if method == "awq":
            qweight, qzeros = awq_pack(q, zeros)
        else:
            qweight, qzeros = gptq_pack(q, zeros)
            tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
        tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "zero_point": True, "group_size": group, "bits": 4, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
         "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(config))
    copy_tokenizer(out)
    state = model.state_dict()
    state.update({f"{name}.weight": w for name, w in reference.items()})
    model.load_state_dict(state)
    return reference, model


# ---- a lowbit (modelopt layout) FP8 checkpoint, quantized by lowbit's own registry (no modelopt needed)
def lowbit_fp8_checkpoint(out, fmt, kv_cache: bool = True, exclude=("lm_head",), seed: int = 0) -> None:
    """Every linear but `exclude` in `fmt` (one shared input amax, so q/k/v and gate/up share input_scale), and FP8
    KV scales, as modelopt's export lays them out."""
    from safetensors.torch import load_file, save_file

    from lowbit import formats
    from lowbit.formats.layers import excluded

    model = tiny_llama(seed)
    model.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    for name in [k.rsplit(".", 1)[0] for k in tensors if k.endswith("_proj.weight")]:
        if any(excluded(name, p) for p in exclude):
            continue
        t = fmt.quantize(tensors.pop(f"{name}.weight"), x_amax=6.0, group=32)
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
    quant = {"quant_algo": fmt.name, "exclude_modules": list(exclude),
             "kv_cache_quant_algo": formats.KV_FP8.name if kv_cache else None}
    if kv_cache:
        for layer in range(SMALL["num_hidden_layers"]):
            tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = torch.tensor(0.02)
            tensors[f"model.layers.{layer}.self_attn.v_proj.v_scale"] = torch.tensor(0.03)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    copy_tokenizer(out)
