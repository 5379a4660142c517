"""AutoAWQ GEMM checkpoints (quant_method "awq", version "gemm") mapped onto lowbit's W4A16_ZP format.

Per linear: qweight int32 [in, out/8] and qzeros int32 [in/group, out/8], both packed along the output dim with
AutoAWQ's interleave (nibble slot i of word c holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]); scales fp16
[in/group, out]; w = (q - z) * s with q, z unsigned 4-bit. Other versions (gemv, marlin, exllama) are refused.
"""
import torch

from lowbit import formats
from lowbit.checkpoint.interop.common import (Foreign, check_dtype, check_shape, int4_tensors, quant_dict, take,
                                              tensor_headers, unpack_nibbles)
from lowbit.errors import UserError

METHOD = "awq"
ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # element j of a word is in nibble slot ORDER[j] (inverse of [0, 2, 4, 6, 1, ...])


def read(path, config: dict, files: list) -> Foreign:
    qc = config["quantization_config"]
    version, bits = str(qc.get("version", "gemm")).lower(), qc.get("bits", qc.get("w_bit", 4))
    if version != "gemm" or bits != 4:
        raise UserError(f"{path}: AutoAWQ version {version!r} with {bits} bits is not read (4-bit GEMM only)")
    modules = sorted(k.rsplit(".", 1)[0] for k in tensor_headers(files) if k.endswith(".qweight"))
    group = qc.get("group_size", qc.get("q_group_size"))
    layers = {name: (formats.W4A16_ZP, group) for name in modules}
    return Foreign(quant_dict(METHOD, layers), lambda tensors: convert(path, modules, tensors))


def convert(path, modules: list, tensors: dict) -> dict:
    tensors = dict(tensors)
    for name in modules:
        t = linear_tensors(path, name, take(tensors, f"{name}.qweight", path), take(tensors, f"{name}.qzeros", path),
                           take(tensors, f"{name}.scales", path))
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
    return tensors


def linear_tensors(path, name: str, qweight, qzeros, scales) -> dict:
    """One AutoAWQ GEMM linear -> W4A16_ZP tensors."""
    check_dtype(f"{name}.qweight", qweight, torch.int32, path)
    check_dtype(f"{name}.qzeros", qzeros, torch.int32, path)
    inp, out = qweight.shape[0], 8 * qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != out or scales.shape[0] == 0 or inp % scales.shape[0]:
        raise UserError(f"{path}: tensor {name}.scales has shape {tuple(scales.shape)}, expected (groups, {out}) "
                        f"with groups dividing {inp}")
    check_shape(f"{name}.qzeros", qzeros, (scales.shape[0], out // 8), path)
    q = unpack_nibbles(qweight, 1, ORDER).t().to(torch.int8) - 8  # [out, in]
    zero = unpack_nibbles(qzeros, 1, ORDER).t().to(torch.int8) - 8  # [out, groups]
    return int4_tensors(q, scales.t(), zero, f"{name}.qweight", path)
