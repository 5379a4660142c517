"""NVFP4 weight block-scale search: each 16-weight block's e4m3 scale chosen among its max-derived scale and the
next smaller e4m3 codes, by the rounding error it causes; applied by clamping the block's weights.

The checkpoint format does not change: modelopt derives every block scale from the block's max (dynamic), so a block
clamped to c = 6 * S * global_scale gets exactly the e4m3 block scale S, and its clamped weights saturate at code 6,
as a clip would. The per-tensor scale (weight_scale_2 = amax / (6 * 448)) stays fixed: the search first gives linears
that read one input (q/k/v, gate/up) the one weight amax export will give them (their max), and blocks that hold
that amax keep their plain scale, so every tensor's amax and weight_scale_2 are what export writes.

Errors (per block b of row o, e = q(w) - w over the block's 16 columns):
  mse     sum_k e_k^2
  output  sum_k E[x_k^2] e_k^2, x the linear's inputs in the float model on the calibration tokens (AWQ's clip
          loss without the cross terms within a block, which changed nothing measurable on the embedded model)
"""
import torch
from torch import nn

from lowbit.calibrate.nvfp4_cpu import E2M1_MAX, E4M3_MAX, MIN_BLOCK_SCALE

ERRORS = ("mse", "output")
STEPS = 8  # e4m3 codes below the plain scale tried (8 codes = one octave: scales down to ~0.5x)
BLOCK = 16


def round_e2m1_fast(mag: torch.Tensor) -> torch.Tensor:
    """nvfp4_cpu.round_e2m1 in fewer passes: the e2m1 magnitudes are multiples of 0.5 below 2, of 1 below 4, then
    4 and 6; dividing by a power of 2 is exact and round() sends halves to even multiples, which are the even codes."""
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return (mag / step).round_().mul_(step).clamp_(max=E2M1_MAX)


def block_errors(w: torch.Tensor, global_scale: torch.Tensor, weight: torch.Tensor | None = None,
                 steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in % 16 == 0), weight [in] per-column error weights (None: plain MSE) ->
    (scales [steps + 1, out, in/16]: candidate block scales in units of global_scale, step 0 the plain one;
    losses [steps + 1, out, in/16]). A candidate that would underflow e4m3 or modelopt's minimum scale gets inf."""
    blocks = w.float().reshape(w.shape[0], -1, BLOCK)
    mag = blocks.abs()
    plain = (mag.amax(-1) / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    codes = plain.view(torch.uint8).int()
    cw = None if weight is None else weight.float().reshape(-1, BLOCK)  # [in/16, 16]
    scales, losses = [], []
    for k in range(steps + 1):
        code = (codes - k).clamp(min=0).to(torch.uint8)
        s = code.view(torch.float8_e4m3fn).float()
        scale = s * global_scale
        ok = (code > 0) & (scale >= MIN_BLOCK_SCALE) if k else torch.ones_like(code, dtype=torch.bool)
        safe = torch.where(scale >= MIN_BLOCK_SCALE, scale, torch.ones_like(scale)).unsqueeze(-1)
        err = round_e2m1_fast(mag / safe) * safe - mag  # |q(w)| - |w|: rounding keeps the sign
        loss = (err.pow(2) * cw).sum(-1) if cw is not None else err.pow(2).sum(-1)
        scales.append(s)
        losses.append(torch.where(ok, loss, torch.full_like(loss, float("inf"))))
    return torch.stack(scales), torch.stack(losses)


def search_clamp(w: torch.Tensor, amax: torch.Tensor, weight: torch.Tensor | None = None,
                 steps: int = STEPS) -> torch.Tensor:
    """w [out, in], amax: the per-tensor weight amax -> w with each block clamped to its chosen scale x 6."""
    global_scale = amax.float().amax() / (E2M1_MAX * E4M3_MAX)
    scales, losses = block_errors(w, global_scale, weight, steps)
    best = losses.argmin(0)  # ties keep the earlier candidate: the plain scale first
    blocks = w.float().reshape(w.shape[0], -1, BLOCK)
    holds_max = blocks.abs().amax(-1) >= amax.float().amax()
    best = torch.where(holds_max, torch.zeros_like(best), best)
    c = (scales.gather(0, best.unsqueeze(0)).squeeze(0) * global_scale * E2M1_MAX).unsqueeze(-1)
    clamped = torch.where(best.unsqueeze(-1) > 0, blocks.clamp(-c, c), blocks)
    return clamped.reshape(w.shape).to(w.dtype)


def add_column_squares(store: dict, name: str, x: torch.Tensor) -> None:
    """store[name] += the sum over x's rows of each column's square ([in], fp32): the `output` error's E[x^2]."""
    sq = x.detach().reshape(-1, x.shape[-1]).float().pow(2).sum(0)
    store[name] = store[name] + sq if name in store else sq


def _nvfp4_weight_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from modelopt.torch.quantization.utils import is_quantized_linear

    out = []
    for name, m in model.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        if not is_quantized_linear(m) or not wq.is_enabled or wq.block_sizes is None:
            continue
        if wq.num_bits == (2, 1) and wq.block_sizes.get("scale_bits") == (4, 3) and wq.block_sizes[-1] == BLOCK:
            out.append((name, m))
    return out


def input_squares(model: nn.Module, linears: list[tuple[str, nn.Module]], forward_loop) -> dict[str, torch.Tensor]:
    """{name: [in] sum over calibration tokens of each input column's square}, from one forward_loop call on the
    float model (every quantizer off while it runs), as the layer-by-layer path sees its inputs."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    on = [q for q in model.modules() if isinstance(q, TensorQuantizer) and q.is_enabled]
    squares = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: add_column_squares(squares, name, args[0]))
             for name, m in linears]
    for q in on:
        q.disable()
    try:
        forward_loop(model)
    finally:
        for q in on:
            q.enable()
        for h in hooks:
            h.remove()
    return squares


def _share_weight_amax(model: nn.Module) -> None:
    """Export's fusion step, run now: linears that read one input get one weight (and input) amax, their max."""
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    if not getattr(model.config, "architectures", None):  # modelopt reads it (as export.py sets it)
        model.config.architectures = [type(model).__name__]
    requantize_resmooth_fused_llm_layers(model)


@torch.no_grad()
def nvfp4_weight_scale_search(model: nn.Module, forward_loop, error: str = "mse") -> int:
    """Clamps the weights of every NVFP4-quantized linear (after max calibration) to the block scales that
    minimise `error`; forward_loop runs once for `output`. Returns the number of blocks given a smaller scale."""
    if error not in ERRORS:
        raise ValueError(f"unknown NVFP4 weight error {error!r} (use {' or '.join(ERRORS)})")
    _share_weight_amax(model)
    linears = _nvfp4_weight_linears(model)
    second = input_squares(model, linears, forward_loop) if error == "output" else {}
    changed = 0
    for name, m in linears:
        new = search_clamp(m.weight.data, m.weight_quantizer.amax, second.get(name))
        changed += int((new != m.weight.data).reshape(m.weight.shape[0], -1, BLOCK).any(-1).sum())
        m.weight.data.copy_(new)
    return changed
