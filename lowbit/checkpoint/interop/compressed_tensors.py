"""compressed-tensors checkpoints (llm-compressor's output) mapped onto lowbit's formats.

Schemes read (config_groups[*].weights / input_activations; anything else is refused with one line naming it):
- float 8-bit weights: tensor weights + static tensor input -> FP8; channel or tensor weights + dynamic per-token
  input -> FP8_PER_CHANNEL_PER_TOKEN (a tensor weight scale repeated on every row).
- int 8-bit symmetric channel weights + static symmetric tensor int8 input -> W8A8_SQ_PER_CHANNEL with a
  pre_quant_scale of ones (the same math; llm-compressor folds SmoothQuant into the norms); with symmetric dynamic
  per-token int8 input (llm-compressor's W8A8 preset) -> INT8_PER_CHANNEL_PER_TOKEN.
- pack-quantized int 4-bit group / channel weights, no input quantization -> W4A16_AWQ (symmetric) or W4A16_ZP
  (asymmetric); weight_packed int32 [out, in/8] holds q + 8 with element i at bits 4*i, zero points int32 packed
  along the output rows.
- nvfp4-pack-quantized -> NVFP4 (with input_global_scale) or W4A16_NVFP4; the global scales on disk are the
  reciprocals of modelopt's weight_scale_2 / input_scale.
- kv_cache_scheme float 8-bit per tensor -> the FP8 KV format; self_attn.k_scale / v_scale are renamed to it.
`ignore` lists (names and `re:` patterns) leave those modules in float; a module with quantization tensors on disk
that a group does not target, or that `ignore` names, is an error.
"""
import re

import torch

from lowbit import formats
from lowbit.checkpoint.interop.common import (Foreign, check_dtype, check_shape, int4_tensors, is_float_dtype,
                                              quant_dict, take, tensor_headers, unpack_nibbles)
from lowbit.errors import UserError

METHOD = "compressed-tensors"
# on-disk suffixes that only a quantized module has (or a weight in an integer / float8 dtype)
MARKERS = ("weight_scale", "weight_packed", "weight_global_scale", "input_scale", "input_global_scale")


def matches(target: str, name: str) -> bool:
    """A config target or ignore entry: `re:` regex (re.match), a module name, or a class name (every linear)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or ("." not in target and target[:1].isupper() and target != "Embedding")


def read(path, config: dict, files: list) -> Foreign:
    qc = config["quantization_config"]
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise UserError(f"{path}: compressed-tensors quantization_status {status!r} is not read (compressed only)")
    headers = tensor_headers(files)
    modules = sorted({k.rsplit(".", 1)[0] for k, (_, dtype) in headers.items() if k.rsplit(".", 1)[-1] in MARKERS or
                      (k.endswith(".weight") and not is_float_dtype(dtype))})
    layers = {name: _layer(path, qc, name) for name in modules}
    kv = _kv_format(path, qc.get("kv_cache_scheme"))
    return Foreign(quant_dict(METHOD, {n: (fmt, g) for n, (fmt, g, _) in layers.items()}, kv),
                   lambda tensors: convert(path, layers, kv, tensors))


def _layer(path, qc: dict, name: str):
    """(Format, group size, scheme) of one quantized module."""
    if any(matches(t, name) for t in qc.get("ignore") or ()):
        raise UserError(f"{path}: {name} has quantization tensors but compressed-tensors `ignore` names it")
    for group_name, group in (qc.get("config_groups") or {}).items():
        if any(matches(t, name) for t in group.get("targets") or ()):
            fmt = _scheme_format(path, group, group.get("format") or qc.get("format"), f"{group_name} ({name})")
            return fmt, group["weights"].get("group_size"), group
    raise UserError(f"{path}: {name} has quantization tensors but no compressed-tensors config group targets it")


def _scheme_format(path, scheme: dict, fmt: str | None, where: str) -> formats.Format:
    w, a = scheme.get("weights") or {}, scheme.get("input_activations")
    kind = (w.get("type"), w.get("num_bits"), w.get("strategy"))
    act = None if a is None else (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic")))
    found = None
    if kind[:2] == ("float", 8) and act == ("float", 8, "tensor", False) and kind[2] == "tensor":
        found = formats.FP8
    elif kind[:2] == ("float", 8) and act == ("float", 8, "token", True) and kind[2] in ("tensor", "channel"):
        found = formats.FP8_PER_CHANNEL_PER_TOKEN
    elif (kind == ("int", 8, "channel") and w.get("symmetric", True) and act == ("int", 8, "tensor", False)
          and a.get("symmetric", True)):
        found = formats.W8A8_SQ_PER_CHANNEL
    elif (kind == ("int", 8, "channel") and w.get("symmetric", True) and act == ("int", 8, "token", True)
          and a.get("symmetric", True)):
        found = formats.INT8_PER_CHANNEL_PER_TOKEN
    elif kind[:2] == ("int", 4) and kind[2] in ("group", "channel") and act is None and fmt == "pack-quantized":
        found = formats.W4A16_AWQ if w.get("symmetric", True) else formats.W4A16_ZP
    elif kind == ("float", 4, "tensor_group") and w.get("group_size") == formats.NVFP4_BLOCK and \
            fmt == "nvfp4-pack-quantized":
        found = formats.W4A16_NVFP4 if act is None else (formats.NVFP4 if act[:3] == ("float", 4, "tensor_group")
                                                         else None)
    if found is None:
        raise UserError(f"{path}: compressed-tensors scheme {where}: format {fmt}, weights {w}, input_activations "
                        f"{a} has no lowbit format")
    return found


def _kv_format(path, scheme: dict | None) -> formats.KVFormat | None:
    if scheme is None:
        return None
    if (scheme.get("type"), scheme.get("num_bits"), scheme.get("dynamic", False)) == ("float", 8, False) and \
            scheme.get("strategy", "tensor") == "tensor":
        return formats.KV_FP8
    raise UserError(f"{path}: compressed-tensors kv_cache_scheme {scheme} has no lowbit KV format")


def convert(path, layers: dict, kv: formats.KVFormat | None, tensors: dict) -> dict:
    """On-disk compressed-tensors tensors -> lowbit's names and layouts (repacked once)."""
    by_module, out = {}, {}
    for key in [k for k in tensors if k.rsplit(".", 1)[0] in layers]:
        by_module.setdefault(key.rsplit(".", 1)[0], {})[key] = tensors.pop(key)
    for name, (fmt, _, _) in layers.items():
        local = by_module.get(name, {})
        t = _CONVERT[fmt.name](path, name, local)
        if f"{name}.bias" in local:
            t["bias"] = local.pop(f"{name}.bias")
        out.update({f"{name}.{k}": v for k, v in t.items()})
    if kv is not None:
        for key in [k for k in tensors if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))]:
            attn, kind = key.rsplit(".", 1)
            out[f"{attn}.{kv.scale_names()[kind[0]]}"] = tensors.pop(key).float().reshape(())
    out.update(tensors)
    return out


def _scalar(name: str, t: torch.Tensor, path) -> torch.Tensor:
    if t.numel() != 1:
        raise UserError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected one value")
    return t.float().reshape(())


def _fp8(path, name, t: dict) -> dict:
    w = take(t, f"{name}.weight", path)
    check_dtype(f"{name}.weight", w, torch.float8_e4m3fn, path)
    return {"weight": w, "weight_scale": _scalar(f"{name}.weight_scale", take(t, f"{name}.weight_scale", path), path),
            "input_scale": _scalar(f"{name}.input_scale", take(t, f"{name}.input_scale", path), path)}


def _row_scale(path, name: str, t: dict, rows: int) -> torch.Tensor:
    """weight_scale [out, 1] (channel) or [1] (tensor, repeated) -> fp32 [out]."""
    s = take(t, f"{name}.weight_scale", path)
    if s.numel() == 1:
        return s.float().reshape(1).expand(rows).contiguous()
    check_shape(f"{name}.weight_scale", s, (rows, 1), path)
    return s.float().reshape(rows)


def _fp8_per_token(path, name, t: dict) -> dict:
    w = take(t, f"{name}.weight", path)
    check_dtype(f"{name}.weight", w, torch.float8_e4m3fn, path)
    return {"weight": w, "weight_scale": _row_scale(path, name, t, w.shape[0])}


def _int8(path, name, t: dict) -> dict:
    w = take(t, f"{name}.weight", path)
    check_dtype(f"{name}.weight", w, torch.int8, path)
    return {"weight": w, "weight_scale": _row_scale(path, name, t, w.shape[0]),
            "input_scale": _scalar(f"{name}.input_scale", take(t, f"{name}.input_scale", path), path),
            "pre_quant_scale": torch.ones(w.shape[1], device=w.device)}


def _int8_per_token(path, name, t: dict) -> dict:
    w = take(t, f"{name}.weight", path)
    check_dtype(f"{name}.weight", w, torch.int8, path)
    return {"weight": w, "weight_scale": _row_scale(path, name, t, w.shape[0])}


def _int4(path, name, t: dict, asymmetric: bool = False) -> dict:
    packed = take(t, f"{name}.weight_packed", path)
    out, inp = (int(v) for v in take(t, f"{name}.weight_shape", path).tolist())
    check_dtype(f"{name}.weight_packed", packed, torch.int32, path)
    check_shape(f"{name}.weight_packed", packed, (out, -(-inp // 8)), path)
    scale = take(t, f"{name}.weight_scale", path)
    if scale.dim() != 2 or scale.shape[0] != out:
        raise UserError(f"{path}: tensor {name}.weight_scale has shape {tuple(scale.shape)}, expected ({out}, groups)")
    q = unpack_nibbles(packed, 1)[:, :inp].to(torch.int8) - 8
    zero = None
    if asymmetric:
        zp = take(t, f"{name}.weight_zero_point", path)
        check_shape(f"{name}.weight_zero_point", zp, (-(-out // 8), scale.shape[1]), path)
        zero = unpack_nibbles(zp, 0)[:out].to(torch.int8) - 8
    return int4_tensors(q, scale, zero, f"{name}.weight_packed", path)


def _nvfp4(path, name, t: dict) -> dict:
    w = take(t, f"{name}.weight_packed", path)
    check_dtype(f"{name}.weight_packed", w, torch.uint8, path)
    scale = take(t, f"{name}.weight_scale", path)
    check_shape(f"{name}.weight_scale", scale, (w.shape[0], 2 * w.shape[1] // formats.NVFP4_BLOCK), path)
    g = _scalar(f"{name}.weight_global_scale", take(t, f"{name}.weight_global_scale", path), path)
    out = {"weight": w, "weight_scale": scale.to(torch.float8_e4m3fn), "weight_scale_2": 1.0 / g}
    if f"{name}.input_global_scale" in t:
        out["input_scale"] = 1.0 / _scalar(f"{name}.input_global_scale", t.pop(f"{name}.input_global_scale"), path)
    return out


def _w4a16_zp(path, name, t: dict) -> dict:
    return _int4(path, name, t, asymmetric=True)


_CONVERT = {formats.FP8.name: _fp8, formats.FP8_PER_CHANNEL_PER_TOKEN.name: _fp8_per_token,
            formats.W8A8_SQ_PER_CHANNEL.name: _int8, formats.INT8_PER_CHANNEL_PER_TOKEN.name: _int8_per_token,
            formats.W4A16_AWQ.name: _int4,
            formats.W4A16_ZP.name: _w4a16_zp, formats.NVFP4.name: _nvfp4, formats.W4A16_NVFP4.name: _nvfp4}
