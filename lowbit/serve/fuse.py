"""Merges the checkpoint tensors of linears that share an input (q/k/v, gate/up) into one layer's tensors.

One GEMM over the concatenated output rows replaces two or three; the on-disk format stays modelopt's. Per-channel
and per-group scales concatenate exactly. What must be shared (the activation's input_scale and pre_quant_scale,
NVFP4's weight_scale_2) modelopt's export already unifies across such groups; when it differs, the parts are not
merged (`merge_linear_tensors` returns None) and run one by one.

FP8 per-tensor weight scales differ between parts (modelopt calibrates each weight on its own): the merged layer
then carries one weight scale per output row ([N, 1], each part's scalar repeated), which is exact; the FP8 GEMM
applies it in its epilogue.
"""
import torch

SHARED = ("input_scale", "pre_quant_scale", "weight_scale_2")  # must be equal in every part
ROW_WISE = ("weight", "bias")  # concatenated along the output rows
PER_CHANNEL_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NVFP4", "W4A16_NVFP4")


def merge_linear_tensors(algo: str | None, parts: list[dict]) -> dict | None:
    """parts: each linear's tensors by on-disk suffix, in output order -> the merged tensors, or None."""
    keys = set(parts[0])
    if any(set(p) != keys for p in parts):
        return None
    for name in SHARED:
        if name in keys and not all(torch.equal(p[name], parts[0][name]) for p in parts):
            return None
    merged = {name: parts[0][name] for name in SHARED if name in keys}
    for name in ROW_WISE:
        if name in keys:
            merged[name] = torch.cat([p[name] for p in parts])
    if algo == "FP8":
        merged["weight_scale"] = _fp8_weight_scale(parts)
    elif algo in PER_CHANNEL_ALGOS:
        merged["weight_scale"] = torch.cat([p["weight_scale"].reshape(p["weight_scale"].shape[0], -1) for p in parts])
        if parts[0]["weight_scale"].dim() == 1:
            merged["weight_scale"] = merged["weight_scale"].reshape(-1)
    elif algo is not None:
        return None
    extra = keys - set(merged)
    if extra:
        raise ValueError(f"cannot merge linear tensors {sorted(extra)} of quant_algo {algo}")
    return merged


def _fp8_weight_scale(parts: list[dict]) -> torch.Tensor:
    """One scalar when every part has the same; else float32 [N, 1], part i's scalar on each of its rows."""
    scales = [p["weight_scale"].float().reshape(()) for p in parts]
    if all(torch.equal(s, scales[0]) for s in scales):
        return parts[0]["weight_scale"]
    return torch.cat([s.expand(p["weight"].shape[0]) for p, s in zip(parts, scales)]).reshape(-1, 1)
