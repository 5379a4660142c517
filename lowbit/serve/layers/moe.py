"""Sparse mixture-of-experts block: a top-k softmax router (kept 16-bit; lowbit.kernels.moe_route) and the experts
stacked per projection, run over all tokens at once by lowbit.kernels.fused_moe (tokens sorted by expert, grouped GEMMs,
weighted combine)."""
import torch
from torch import nn

from lowbit import formats, kernels
from lowbit.serve.layers import ops
from lowbit.serve.layers.linear import Linear


class MoeExperts(nn.Module):
    """num_experts gated MLPs as two stacked weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
    w2 [E, H, I]. Built empty; the loader fills them from the checkpoint's per-expert linears named
    `{e}.{part}.weight` (part_names: gate, up, down) or from transformers' fused `gate_up_proj` / `down_proj`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.part_names = part_names
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.fp8 = None  # kernels.Fp8Scales when w13 / w2 are float8_e4m3fn
        self.int4 = None  # kernels.Int4Scales when w13 / w2 are packed INT4 (uint8 [E, I, H] / [E, H/2, I])
        self.int8 = None  # kernels.Int8Scales when w13 / w2 are int8 (W8A8 SmoothQuant)
        self.nvfp4 = None  # kernels.Nvfp4Scales when w13 / w2 are NVFP4 e2m1 codes (uint8 [E, 2I, H/2] / [E, H, I/2])

    def load(self, w13: torch.Tensor, w2: torch.Tensor, device, dtype) -> None:
        e, h, i = self.num_experts, self.hidden, self.intermediate
        if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
            raise ValueError(f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)}; expected {(e, 2 * i, h)}, "
                             f"{(e, h, i)}")
        self.w13 = w13.to(device, dtype).contiguous()
        self.w2 = w2.to(device, dtype).contiguous()

    def load_quantized(self, fmt: formats.Format, experts: list, device, where: str) -> None:
        """experts[e] = (gate, up, down) checkpoint tensors ({suffix: tensor}) of format fmt: static per-tensor FP8,
        FP8 with per-token activations (per-channel weights), INT8 W8A8 SmoothQuant, W4A16 INT4 (AWQ / RTN, no zero
        point) or NVFP4. gate and up merge by the format's rule (a shared input scale or pre_quant_scale); each expert
        keeps its own scales. where: the experts' checkpoint name, for errors."""
        if len(experts) != self.num_experts:
            raise ValueError(f"{where}: {len(experts)} experts; expected {self.num_experts}")
        if fmt.kernel == "fp8" and fmt.activation in (formats.ACT_STATIC, formats.ACT_PER_TOKEN):
            self._load_fp8(fmt, experts, device, where)
        elif fmt.kernel == "int8" and fmt.activation == formats.ACT_STATIC:
            self._load_int8(fmt, experts, device, where)
        elif fmt.kernel == "int4" and fmt.activation == formats.ACT_NONE:
            self._load_int4(fmt, experts, device, where)
        elif fmt.kernel == "nvfp4":
            self._load_nvfp4(experts, device, where)
        else:
            raise ValueError(f"{where}: {fmt.name} experts are not supported (FP8 with static or per-token "
                             f"activations, INT8 with static activations, W4A16 INT4 and NVFP4 experts are)")

    def _merged(self, fmt, experts: list, where: str, allowed: set, packed_rows: int = 1) -> list:
        """Per expert (merged gate/up, down) tensors, checked: only `allowed` suffixes, weights of the expected
        shapes (packed_rows output rows per stored row)."""
        h, i = self.hidden, self.intermediate
        out = []
        for idx, (gate, up, down) in enumerate(experts):
            extra = (set(gate) | set(up) | set(down)) - allowed
            if extra:
                raise ValueError(f"{where}.{idx}: expert tensors {sorted(extra)} are not supported")
            merged = fmt.merge([gate, up])
            if merged is None:
                raise ValueError(f"{where}.{idx}: gate and up have different input scales and cannot merge")
            for label, t, shape in (("gate/up", merged, (2 * i // packed_rows, h)),
                                    ("down", down, (h // packed_rows, i))):
                if tuple(t["weight"].shape) != shape:
                    raise ValueError(f"{where}.{idx}: {label} weight {tuple(t['weight'].shape)}; expected {shape}")
            out.append((merged, down))
        return out

    def _load_fp8(self, fmt, experts: list, device, where: str) -> None:
        """Per-token formats keep no input scales (an input_scale on disk is ignored, as for dense layers)."""
        h, i = self.hidden, self.intermediate
        per_token = fmt.activation == formats.ACT_PER_TOKEN
        w13, w2, s13, a13, s2, a2 = [], [], [], [], [], []
        for merged, down in self._merged(fmt, experts, where, {"weight", "weight_scale", "input_scale"}):
            w13.append(merged["weight"].to(device))
            w2.append(down["weight"].to(device))
            s13.append(_row_scales(merged["weight_scale"], 2 * i).to(device))
            s2.append(_row_scales(down["weight_scale"], h).to(device))
            if not per_token:
                a13.append(merged["input_scale"].float().reshape(()).to(device))
                a2.append(down["input_scale"].float().reshape(()).to(device))
        self.w13, self.w2 = torch.stack(w13).contiguous(), torch.stack(w2).contiguous()
        stack = (lambda t: None) if per_token else torch.stack
        self.fp8 = kernels.Fp8Scales(torch.stack(s13), stack(a13), torch.stack(s2), stack(a2))

    def _load_int8(self, fmt, experts: list, device, where: str) -> None:
        """int8 weights with a scale per output row, each expert's static input scale, and its pre_quant_scale (ones
        where a checkpoint has none: modelopt 0.47 does not smooth transformers' fused experts)."""
        h, i = self.hidden, self.intermediate
        w13, w2, s13, a13, m13, s2, a2, m2 = [], [], [], [], [], [], [], []
        allowed = {"weight", "weight_scale", "input_scale", "pre_quant_scale"}
        for merged, down in self._merged(fmt, experts, where, allowed):
            for t, w, s, a, m, rows, k in ((merged, w13, s13, a13, m13, 2 * i, h), (down, w2, s2, a2, m2, h, i)):
                if t["weight"].dtype != torch.int8:
                    raise ValueError(f"{where}: INT8 expert weights are {t['weight'].dtype}")
                w.append(t["weight"].to(device))
                s.append(_row_scales(t["weight_scale"], rows).to(device))
                a.append(t["input_scale"].float().reshape(()).to(device))
                m.append(t.get("pre_quant_scale", torch.ones(k)).float().reshape(k).to(device))
        self.w13, self.w2 = torch.stack(w13).contiguous(), torch.stack(w2).contiguous()
        self.int8 = kernels.Int8Scales(*(torch.stack(t) for t in (s13, a13, m13, s2, a2, m2)))

    def _load_int4(self, fmt, experts: list, device, where: str) -> None:
        """Packed uint8 rows kept as on disk (two output rows per byte); fp32 group scales; pre_quant_scale, or
        ones where a checkpoint has none (RTN)."""
        h, i = self.hidden, self.intermediate
        w13, w2, s13, m13, s2, m2 = [], [], [], [], [], []
        allowed = {"weight", "weight_scale", "pre_quant_scale"}
        for merged, down in self._merged(fmt, experts, where, allowed, packed_rows=2):
            w13.append(merged["weight"].to(device))
            w2.append(down["weight"].to(device))
            s13.append(merged["weight_scale"].float().to(device))
            s2.append(down["weight_scale"].float().to(device))
            m13.append(merged.get("pre_quant_scale", torch.ones(h)).float().reshape(h).to(device))
            m2.append(down.get("pre_quant_scale", torch.ones(i)).float().reshape(i).to(device))
        for label, scales in (("gate/up", s13), ("down", s2)):
            if len({tuple(s.shape) for s in scales}) != 1:
                raise ValueError(f"{where}: the experts' {label} group sizes differ")
        self.w13, self.w2 = torch.stack(w13).contiguous(), torch.stack(w2).contiguous()
        self.int4 = kernels.Int4Scales(torch.stack(s13), torch.stack(m13), torch.stack(s2), torch.stack(m2))
        for w, s in ((self.w13, self.int4.w13_scale), (self.w2, self.int4.w2_scale)):
            group = w.shape[2] // s.shape[2]
            if group % 16 or group * s.shape[2] != w.shape[2] or s.shape[1] != 2 * w.shape[1]:
                raise ValueError(f"{where}: INT4 expert scales {tuple(s.shape[1:])} do not fit weights "
                                 f"{tuple(w.shape[1:])} in groups of a multiple of 16")

    def _load_nvfp4(self, experts: list, device, where: str) -> None:
        """Weight-only, as lowbit serves NVFP4 on Hopper (an input_scale on disk is not used): codes and e4m3 block
        scales as on disk, gate's and up's rows concatenated; weight_scale_2 repeated over each part's output rows, so
        gate and up need not share it."""
        h, i = self.hidden, self.intermediate
        allowed = {"weight", "weight_scale", "weight_scale_2", "input_scale"}
        w13, w2, b13, g13, b2, g2 = [], [], [], [], [], []
        for idx, (gate, up, down) in enumerate(experts):
            extra = (set(gate) | set(up) | set(down)) - allowed
            if extra:
                raise ValueError(f"{where}.{idx}: expert tensors {sorted(extra)} are not supported")
            for label, t, rows, k in (("gate", gate, i, h), ("up", up, i, h), ("down", down, h, i)):
                shapes = (tuple(t["weight"].shape), tuple(t["weight_scale"].shape), t["weight_scale_2"].numel())
                if shapes != ((rows, k // 2), (rows, k // 16), 1) or t["weight_scale"].dtype != torch.float8_e4m3fn:
                    raise ValueError(f"{where}.{idx}: NVFP4 {label} tensors {shapes}; expected weight "
                                     f"{(rows, k // 2)}, float8 weight_scale {(rows, k // 16)}, one weight_scale_2")
            glob = lambda t, rows: t["weight_scale_2"].float().reshape(1).expand(rows)  # noqa: E731
            w13.append(torch.cat([gate["weight"], up["weight"]]).to(device))
            b13.append(torch.cat([gate["weight_scale"], up["weight_scale"]]).to(device))
            g13.append(torch.cat([glob(gate, i), glob(up, i)]).to(device))
            w2.append(down["weight"].to(device))
            b2.append(down["weight_scale"].to(device))
            g2.append(glob(down, h).to(device))
        self.w13, self.w2 = torch.stack(w13).contiguous(), torch.stack(w2).contiguous()
        self.nvfp4 = kernels.Nvfp4Scales(torch.stack(b13), torch.stack(g13), torch.stack(b2), torch.stack(g2))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sum over each token's top_k experts of weight * expert(x) [T, H]."""
        return ops.fused_moe(x, self.w13, self.w2, topk_ids, topk_weights, fp8=self.fp8, int4=self.int4,
                             nvfp4=self.nvfp4, int8=self.int8)


def _row_scales(weight_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor scale or one per output row ([rows] / [rows, 1]) -> float32 [rows]."""
    s = weight_scale.float().reshape(-1)
    return s.expand(rows).clone() if s.numel() == 1 else s


class SparseMoe(nn.Module):
    """gate (router linear, HF name `gate`) -> route -> experts (HF name `experts`)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} is not in 1..num_experts ({num_experts})")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden, num_experts)
        self.experts = MoeExperts(num_experts, hidden, intermediate, part_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        gate = self.gate
        if gate.algo is None and gate.bias is None and gate.combine is None:  # the router's linear and top-k in one op
            weights, ids, _ = ops.moe_router(x, gate.weight, self.top_k, self.renormalize)
        else:
            weights, ids = ops.moe_route(gate(x), self.top_k, self.renormalize)
        return self.experts(x, ids, weights)
