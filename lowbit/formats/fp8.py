"""FP8: float8_e4m3fn weight with one fp32 weight_scale, static per-tensor fp32 input_scale (both amax/448).

Merging parts (q/k/v, gate/up): modelopt calibrates each weight's per-tensor scale on its own, so they differ. Two
exact merges:
- by default the merged layer carries one weight scale per output row ([N, 1], each part's scalar repeated), which
  the FP8 GEMM applies in its epilogue (cuBLAS's row-wise path, slower than per-tensor);
- with `part_scales` (r_i = s_i / s_0) the merged weight scale is part 0's scalar s_0, so the GEMM stays
  per-tensor, and part i's output comes out divided by r_i (its bias is stored as b_i / r_i). The layer's consumer
  multiplies it back (silu_and_mul's up_scale, rotary_store_kv's part_scales).
"""
import torch

from lowbit.formats.base import ACT_STATIC, Calibration, Format, Tensors, register
from lowbit.formats.numerics import FP8_MAX, amax, fake_quant_fp8


class Fp8(Format):
    name = "FP8"
    tensors = Tensors(("weight", "weight_scale", "input_scale"))
    weight_only = False
    activation = ACT_STATIC
    kernel = "fp8"
    static_fp8_input = True
    calibration = Calibration("FP8_DEFAULT_CFG", ("max", "mse"), modelopt_layer_format="fp8")

    def dequantize(self, t: dict) -> torch.Tensor:
        return t["weight"].float() * t["weight_scale"].float()

    def quantize(self, w, *, group=128, smooth=None, x_amax=4.0, w_amax=None) -> dict:
        w = w.float()
        t = {"weight_scale": amax(w) / FP8_MAX}
        t["weight"] = (w / t["weight_scale"]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        t["input_scale"] = torch.tensor(x_amax / FP8_MAX)
        return t

    def _quantize_input(self, x: torch.Tensor, t: dict) -> torch.Tensor:
        return fake_quant_fp8(x, t["input_scale"].float()).to(x.dtype)

    def part_scales(self, parts: list[dict]) -> torch.Tensor | None:
        """Parts with unequal (positive) per-tensor weight scales s_i -> float32 [n_parts] r_i = s_i / s_0 on their
        device (r_0 = 1); None when the scales are equal, missing or not positive."""
        if any(p.get("weight_scale") is None or p["weight_scale"].numel() != 1 for p in parts):
            return None
        scales = torch.stack([p["weight_scale"].float().reshape(()) for p in parts])
        if torch.equal(scales, scales[:1].expand_as(scales)) or not bool((scales > 0).all()):
            return None
        return scales / scales[0]

    def _merge_weight_scale(self, merged: dict, parts: list[dict]) -> None:
        """One scalar when every part has the same; else float32 [N, 1], part i's scalar on each of its rows."""
        scales = [p["weight_scale"].float().reshape(()) for p in parts]
        if all(torch.equal(s, scales[0]) for s in scales):
            merged["weight_scale"] = parts[0]["weight_scale"]
        else:
            merged["weight_scale"] = torch.cat([s.expand(p["weight"].shape[0])
                                                for p, s in zip(parts, scales)]).reshape(-1, 1)

    def _defer_part_scales(self, merged: dict, parts: list[dict], part_scales: torch.Tensor) -> None:
        if part_scales.shape != (len(parts),):
            super()._defer_part_scales(merged, parts, part_scales)
        merged["weight_scale"] = parts[0]["weight_scale"]
        if "bias" in merged:
            merged["bias"] = torch.cat([p["bias"].float() / r for p, r in zip(parts, part_scales)])  # fp32


FP8 = register(Fp8())
