"""A lowbit checkpoint written as compressed-tensors: the tensors, names and quantization_config llm-compressor writes
for the same scheme (its FP8, FP8_DYNAMIC, W8A8 with static or dynamic per-token input, W4A16 / W4A16_ASYM, NVFP4,
NVFP4A16), for vLLM.

Per format (compressed-tensors suffixes): FP8 `weight`, `weight_scale` [1], `input_scale` [1]; FP8 per channel
`weight`, `weight_scale` [out, 1] (dynamic per-token input); W8A8 SmoothQuant int8 `weight`, `weight_scale` [out, 1],
`input_scale` [1] ("int-quantized"; dynamic per-token input: no input_scale); int4 `weight_packed` int32 [out, in/8]
(q + 8, element j at bits 4*j), `weight_scale` [out, groups], `weight_shape` [2] and, asymmetric, `weight_zero_point`
int32 [out/8, groups] (zero point + 8 packed along the rows) ("pack-quantized"); NVFP4 `weight_packed` uint8 [out, in/2], e4m3 `weight_scale`,
`weight_global_scale` [1] = 1 / weight_scale_2 and `input_global_scale` [1] = 1 / input_scale. Scales stay fp32
(llm-compressor writes the model dtype; fp32 keeps lowbit's numbers). pre_quant_scale vectors are folded upstream
(lowbit.checkpoint.interop.fold). One scheme for every quantized linear targets "Linear" with exclude_modules as
`ignore` (names as they are, wildcards as `re:` patterns); several schemes target module names, one group each.
FP8 KV scales k_proj.k_scale / v_proj.v_scale become self_attn.k_scale / v_scale with a float 8-bit kv_cache_scheme.
"""
import fnmatch
import json
from pathlib import Path

import torch

from lowbit import formats
from lowbit.checkpoint.interop.common import pack_nibbles
from lowbit.checkpoint.interop.fold import fold_pre_quant_scales
from lowbit.errors import UserError

FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
INT8_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
FP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": formats.NVFP4_BLOCK,
            "strategy": "tensor_group"}


def _int4(symmetric: bool):
    return lambda group: ({"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": group,
                           "strategy": "group", "dynamic": False}, None, "pack-quantized")


# lowbit format name -> group size -> (weights, input_activations, compressed-tensors format), as llm-compressor
# writes the same scheme
SCHEMES = {
    formats.FP8.name: lambda g: ({**FP8_ARGS, "strategy": "tensor", "dynamic": False},
                                 {**FP8_ARGS, "strategy": "tensor", "dynamic": False}, "float-quantized"),
    formats.FP8_PER_CHANNEL_PER_TOKEN.name: lambda g: ({**FP8_ARGS, "strategy": "channel", "dynamic": False},
                                                       {**FP8_ARGS, "strategy": "token", "dynamic": True},
                                                       "float-quantized"),
    formats.W8A8_SQ_PER_CHANNEL.name: lambda g: ({**INT8_ARGS, "strategy": "channel", "dynamic": False},
                                                 {**INT8_ARGS, "strategy": "tensor", "dynamic": False},
                                                 "int-quantized"),
    formats.INT8_PER_CHANNEL_PER_TOKEN.name: lambda g: ({**INT8_ARGS, "strategy": "channel", "dynamic": False},
                                                        {**INT8_ARGS, "strategy": "token", "dynamic": True},
                                                        "int-quantized"),
    formats.W4A16_AWQ.name: _int4(True),
    formats.W4A16_ZP.name: _int4(False),
    formats.NVFP4.name: lambda g: ({**FP4_ARGS, "dynamic": False}, {**FP4_ARGS, "dynamic": "local"},
                                   "nvfp4-pack-quantized"),
    formats.W4A16_NVFP4.name: lambda g: ({**FP4_ARGS, "dynamic": False}, None, "nvfp4-pack-quantized"),
}


def ignore_entry(pattern: str) -> str:
    """A modelopt exclude_modules entry -> a compressed-tensors ignore entry matching the same modules."""
    if not any(c in pattern for c in "*?["):
        return pattern
    return "re:" + fnmatch.translate(pattern).removeprefix("(?s:").removesuffix(")\\Z") + "$"


def check_format(fmt: formats.Format, where: str) -> None:
    if fmt.name not in SCHEMES:
        raise UserError(f"{where}: quant_algo {fmt.name!r} has no compressed-tensors form "
                        f"(only {', '.join(SCHEMES)})")


def _group(fmt: formats.Format, t: dict) -> int | None:
    """The int4 group size (in_features per weight_scale column); None for the other formats."""
    if fmt.kernel != "int4":
        return None
    return fmt.shape(t)[1] // t["weight_scale"].shape[1]


def module_tensors(fmt: formats.Format, t: dict) -> dict:
    """One linear's lowbit tensors (suffix -> tensor, bias aside) -> its compressed-tensors tensors."""
    if fmt is formats.FP8:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"].float().reshape(1),
                "input_scale": t["input_scale"].float().reshape(1)}
    if fmt in (formats.FP8_PER_CHANNEL_PER_TOKEN, formats.INT8_PER_CHANNEL_PER_TOKEN):
        return {"weight": t["weight"], "weight_scale": t["weight_scale"].float().reshape(-1, 1)}
    if fmt is formats.W8A8_SQ_PER_CHANNEL:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"].float().reshape(-1, 1),
                "input_scale": t["input_scale"].float().reshape(1)}
    if fmt.kernel == "int4":
        q = formats.unpack_int4_rows(t["weight"]).to(torch.int64)  # [out, in] in [-8, 7]
        out = {"weight_packed": pack_nibbles(q + 8, 1), "weight_scale": t["weight_scale"].float().contiguous(),
               "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
        if fmt is formats.W4A16_ZP:
            out["weight_zero_point"] = pack_nibbles(t["weight_zero_point"].to(torch.int64) + 8, 0)
        return out
    out = {"weight_packed": t["weight"], "weight_scale": t["weight_scale"].to(torch.float8_e4m3fn),
           "weight_global_scale": (1.0 / t["weight_scale_2"].float()).reshape(1)}
    if fmt is formats.NVFP4:
        out["input_global_scale"] = (1.0 / t["input_scale"].float()).reshape(1)
    return out


def _config_groups(schemes: dict, quant: dict) -> tuple[dict, list]:
    """{(format name, group): [modules]} -> (config_groups, ignore)."""
    groups = {}
    uniform = len(schemes) == 1 and quant.get("quant_algo") != formats.MIXED_PRECISION
    for i, ((name, group), modules) in enumerate(sorted(schemes.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))):
        weights, inputs, fmt = SCHEMES[name](group)
        groups[f"group_{i}"] = {"targets": ["Linear"] if uniform else sorted(modules), "weights": weights,
                                "input_activations": inputs, "output_activations": None, "format": fmt}
    ignore = [ignore_entry(p) for p in quant.get("exclude_modules") or ()] if uniform else []
    return groups, ignore


def quantized_modules(tensors: dict) -> list[str]:
    """The linears with quantization tensors (every lowbit format has a weight_scale)."""
    return sorted(k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale"))


def convert(ckpt, tensors: dict | None = None, on_module=None) -> tuple[dict, dict]:
    """A checkpoint lowbit reads -> (quantization_config, tensors) in compressed-tensors layout.
    tensors: ckpt.tensors() when already read (consumed); on_module(): called once per linear converted."""
    if ckpt.quant is None:
        raise UserError(f"{ckpt.path}: an unquantized checkpoint has no compressed-tensors form")
    tensors = ckpt.tensors() if tensors is None else tensors
    kv = ckpt.kv_format
    if kv not in (None, formats.KV_FP8):
        raise UserError(f"{ckpt.path}: KV {ckpt.kv_algo!r} has no compressed-tensors form")
    modules = quantized_modules(tensors)
    fmts = {m: ckpt.layer_format(m) for m in modules}
    for m, fmt in fmts.items():
        check_format(fmt, f"{ckpt.path}: {m}")
    fold_pre_quant_scales(tensors, lambda m: fmts.get(m), ckpt.config, kv is formats.KV_FP8)
    out, schemes = {}, {}
    for m, fmt in fmts.items():
        local = {s: tensors.pop(f"{m}.{s}") for s in (*formats.TENSOR_SUFFIXES, "bias") if f"{m}.{s}" in tensors}
        schemes.setdefault((fmt.name, _group(fmt, local)), []).append(m)
        if "bias" in local:
            out[f"{m}.bias"] = local.pop("bias")
        out.update({f"{m}.{k}": v for k, v in module_tensors(fmt, local).items()})
        if on_module is not None:
            on_module()
    kv_names = {v: k for k, v in formats.KV_FP8.scale_names().items()}  # "k_proj.k_scale" -> "k"
    for name, t in tensors.items():
        tail = ".".join(name.rsplit(".", 2)[-2:])
        if tail in kv_names:
            out[f"{name.rsplit('.', 2)[0]}.{kv_names[tail]}_scale"] = t.float().reshape(1)
        else:
            out[name] = t
    groups, ignore = _config_groups(schemes, ckpt.quant)
    formats_used = {g["format"] for g in groups.values()}
    qc = {"quant_method": "compressed-tensors",
          "format": formats_used.pop() if len(formats_used) == 1 else "mixed-precision",
          "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
          "kv_cache_scheme": {**FP8_ARGS, "strategy": "tensor", "dynamic": False} if kv else None}
    return qc, out


def save(directory: Path, config: dict, qc: dict, tensors: dict) -> None:
    """model.safetensors and config.json (with quantization_config) into `directory`."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = dict(config, quantization_config=qc)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def rewrite(directory: Path) -> None:
    """Rewrites the lowbit checkpoint in `directory` (a temporary export directory) in compressed-tensors layout."""
    from lowbit.checkpoint.io import QUANT_CONFIG, read

    ckpt = read(directory)
    qc, converted = convert(ckpt)
    for f in ckpt.weight_files:
        f.unlink()
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        index.unlink()
    save(directory, ckpt.config, qc, converted)
    (directory / QUANT_CONFIG).unlink()


__all__ = ["SCHEMES", "convert", "quantized_modules", "rewrite", "save", "ignore_entry", "module_tensors", "check_format"]
