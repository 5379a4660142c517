"""Merges the checkpoint tensors of linears that share an input (q/k/v, gate/up) into one layer's tensors.

One GEMM over the concatenated output rows replaces two or three; the on-disk format stays modelopt's. Per-channel
and per-group scales concatenate exactly. What must be shared (the activation's input_scale and pre_quant_scale,
NVFP4's weight_scale_2) modelopt's export already unifies across such groups; when it differs, the parts are not
merged (`merge_linear_tensors` returns None) and run one by one.

FP8 per-tensor weight scales differ between parts (modelopt calibrates each weight on its own). Two exact merges:
- by default the merged layer carries one weight scale per output row ([N, 1], each part's scalar repeated), which
  the FP8 GEMM applies in its epilogue (cuBLAS's row-wise path, slower than per-tensor);
- with `part_scales` (from `fp8_part_scales`: r_i = s_i / s_0) the merged weight scale is part 0's scalar s_0, so
  the GEMM stays per-tensor, and part i's output comes out divided by r_i (its bias is stored as b_i / r_i). The
  layer's consumer multiplies it back (silu_and_mul's up_scale, rotary_store_kv's part_scales).
"""
import torch

SHARED = ("input_scale", "pre_quant_scale", "weight_scale_2")  # must be equal in every part
ROW_WISE = ("weight", "bias")  # concatenated along the output rows
PER_CHANNEL_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NVFP4", "W4A16_NVFP4")


def fp8_part_scales(algo: str | None, parts: list[dict]) -> torch.Tensor | None:
    """FP8 parts with unequal (positive) per-tensor weight scales s_i -> float32 [n_parts] r_i = s_i / s_0 on their
    device (r_0 = 1); None when there is nothing to defer."""
    if algo != "FP8" or any(p.get("weight_scale") is None or p["weight_scale"].numel() != 1 for p in parts):
        return None
    scales = torch.stack([p["weight_scale"].float().reshape(()) for p in parts])
    if torch.equal(scales, scales[:1].expand_as(scales)) or not bool((scales > 0).all()):
        return None
    ratios = scales / scales[0]
    return ratios


def merge_linear_tensors(algo: str | None, parts: list[dict], part_scales: torch.Tensor | None = None) -> dict | None:
    """parts: each linear's tensors by on-disk suffix, in output order -> the merged tensors, or None.

    part_scales: fp8_part_scales(algo, parts), to defer the FP8 parts' scale ratios to the output's consumer.
    """
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
    if part_scales is not None:
        if algo != "FP8" or part_scales.shape != (len(parts),):
            raise ValueError(f"part_scales {tuple(part_scales.shape)} cannot defer {len(parts)} parts of {algo}")
        merged["weight_scale"] = parts[0]["weight_scale"]
        if "bias" in keys:
            merged["bias"] = torch.cat([p["bias"].float() / r for p, r in zip(parts, part_scales)])  # fp32
    elif algo == "FP8":
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
