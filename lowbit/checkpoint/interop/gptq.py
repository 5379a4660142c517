"""GPTQ checkpoints (auto-gptq / gptqmodel, quant_method "gptq", 4-bit) mapped onto lowbit's int4 formats.

Per linear: qweight int32 [in/8, out] packed along the INPUT dim (element 8r + i in bits 4*i of word r);
qzeros int32 [groups, out/8] packed along the output dim in natural order; scales fp16 [groups, out]; g_idx int32
[in] (the group of each input column). checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself.
w[:, k] = (q[:, k] - z[:, g_idx[k]]) * s[:, g_idx[k]].

sym -> W4A16_AWQ (every zero must be 8), asym -> W4A16_ZP. desc_act: a layer whose g_idx is k // group is read as
usual; any other g_idx (act order) has no contiguous groups, and the layer is dequantized at load to an fp32 weight
and served as an unquantized linear (exact, but at 16-bit speed and size).
"""
import torch

from lowbit import formats
from lowbit.checkpoint.interop.common import (Foreign, check_dtype, check_shape, int4_tensors, quant_dict, read_tensors,
                                              take, tensor_headers, unpack_nibbles)
from lowbit.errors import UserError

METHOD = "gptq"


def read(path, config: dict, files: list) -> Foreign:
    qc = config["quantization_config"]
    if qc.get("bits", 4) != 4:
        raise UserError(f"{path}: GPTQ with {qc.get('bits')} bits is not read (4-bit only)")
    fmt_version = qc.get("checkpoint_format", "gptq")
    if fmt_version not in ("gptq", "gptq_v2"):
        raise UserError(f"{path}: GPTQ checkpoint_format {fmt_version!r} is not read (gptq, gptq_v2)")
    shapes = {k: shape for k, (shape, _) in tensor_headers(files).items()}
    modules = sorted(k.rsplit(".", 1)[0] for k in shapes if k.endswith(".qweight"))
    g_idx = read_tensors(files, {f"{m}.g_idx" for m in modules})
    sym = qc.get("sym", True)
    layers, plan = {}, {}
    for name in modules:
        inp = 8 * shapes[f"{name}.qweight"][0]
        group = inp if qc.get("group_size", 128) in (-1, None) else qc.get("group_size", 128)
        ordered = _check_g_idx(path, name, g_idx.get(f"{name}.g_idx"), inp, group, shapes.get(f"{name}.scales"))
        plan[name] = ordered
        if ordered:
            layers[name] = (formats.W4A16_AWQ if sym else formats.W4A16_ZP, group)
    offset = 1 if fmt_version == "gptq" else 0
    return Foreign(quant_dict(METHOD, layers), lambda tensors: convert(path, plan, sym, offset, tensors))


def _check_g_idx(path, name: str, g_idx, inp: int, group: int, scale_shape) -> bool:
    """True when the layer's groups are contiguous (g_idx absent or k // group); a g_idx outside the scales' groups
    is a UserError naming it."""
    if g_idx is None:
        return True
    groups = scale_shape[0] if scale_shape else -(-inp // group)
    check_shape(f"{name}.g_idx", g_idx, (inp,), path)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise UserError(f"{path}: tensor {name}.g_idx holds groups in [{int(g_idx.min())}, {int(g_idx.max())}], "
                        f"outside [0, {groups})")
    return torch.equal(g_idx.long(), torch.arange(inp, device=g_idx.device) // group)


def convert(path, plan: dict, sym: bool, offset: int, tensors: dict) -> dict:
    tensors = dict(tensors)
    for name, ordered in plan.items():
        qweight, qzeros, scales = (take(tensors, f"{name}.{s}", path) for s in ("qweight", "qzeros", "scales"))
        g_idx = tensors.pop(f"{name}.g_idx", None)
        q, zero, scales = unpack(path, name, qweight, qzeros, scales, offset)
        if not ordered:
            tensors[f"{name}.weight"] = dequantize_by_g_idx(q, zero, scales, g_idx.long())
            continue
        if sym and not bool((zero == 8).all()):
            raise UserError(f"{path}: tensor {name}.qzeros holds zero points other than 8 but the config says sym")
        t = int4_tensors(q - 8, scales, None if sym else zero - 8, f"{name}.qweight", path)
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
    return tensors


def unpack(path, name: str, qweight, qzeros, scales, offset: int):
    """-> q int16 [out, in] in [0, 15], zero int16 [out, groups] (offset added), scales [out, groups]."""
    check_dtype(f"{name}.qweight", qweight, torch.int32, path)
    check_dtype(f"{name}.qzeros", qzeros, torch.int32, path)
    out = qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != out:
        raise UserError(f"{path}: tensor {name}.scales has shape {tuple(scales.shape)}, expected (groups, {out})")
    check_shape(f"{name}.qzeros", qzeros, (scales.shape[0], -(-out // 8)), path)
    q = unpack_nibbles(qweight, 0).t().to(torch.int16)
    zero = unpack_nibbles(qzeros, 1)[:, :out].t().to(torch.int16) + offset
    return q, zero, scales.t()


def dequantize_by_g_idx(q, zero, scales, g_idx) -> torch.Tensor:
    """fp32 [out, in] = (q - zero[:, g_idx]) * scales[:, g_idx] (exact in fp32)."""
    return (q.float() - zero[:, g_idx].float()) * scales[:, g_idx].float()
