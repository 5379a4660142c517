"""Experiment: GPTQ rounding of NVFP4 weights after the block-scale search (calibrate/nvfp4_clip.py), on the
fake-quant model: each column rounded to e2m1 x its block's scale (the scales the search left, held static), its
error spread over the later columns through H = 2 X^T X of the float model's inputs (calibrate/gptq.py's update).
The fake quant recomputes block scales from the final weights, so blocks whose largest code GPTQ moved off 6 show
their true (re-rounded) cost. Held-out perplexity on bench/accuracy.py's windows, accuracy_variants' settings.
Usage: OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 dev/bench/nvfp4_gptq.py [--num-seqs 4] [--num-samples 4] [--damp 0.01]
[--select]. The recipe is the shipped one (with its smoothing fold since that shipped)."""
import argparse
import time

import torch

from lowbit.bench.accuracy import heldout, perplexity
from lowbit.bench.accuracy_variants import variant
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.gptq import upper_inverse_factor
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.calibrate.nvfp4_clip import BLOCK, _nvfp4_weight_linears, round_e2m1_fast
from lowbit.calibrate.nvfp4_cpu import E2M1_MAX, E4M3_MAX
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model


def block_scales(w, amax):
    gs = amax.float().amax() / (E2M1_MAX * E4M3_MAX)
    s = (w.abs().reshape(w.shape[0], -1, BLOCK).amax(-1) / (E2M1_MAX * gs)).clamp(max=E4M3_MAX)
    return (s.to(torch.float8_e4m3fn).float() * gs).repeat_interleave(BLOCK, 1)  # [out, in]


def gptq_nvfp4(w, h, scale, damp, block=128):
    w = w.float().clone()
    u = upper_inverse_factor(h, damp)
    inp = w.shape[1]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    for b0 in range(0, inp, block):
        b1 = min(b0 + block, inp)
        wb, errs = w[:, b0:b1].clone(), torch.zeros_like(w[:, b0:b1])
        for i in range(b1 - b0):
            s = safe[:, b0 + i]
            q = torch.sign(wb[:, i]) * round_e2m1_fast(wb[:, i].abs() / s) * s
            errs[:, i] = (wb[:, i] - q) / u[b0 + i, b0 + i]
            wb[:, i:] -= errs[:, i, None] * u[b0 + i, b0 + i:b1][None, :]
            wb[:, i] = q
        w[:, b0:b1] = wb
        w[:, b1:] -= errs @ u[b0:b1, b1:]
    return w


p = argparse.ArgumentParser()
p.add_argument("--num-seqs", type=int, default=4)
p.add_argument("--num-samples", type=int, default=4)
p.add_argument("--damp", type=float, default=0.01)
p.add_argument("--select", action="store_true", help="measure on nvfp4_smooth_alpha.py's calibration-split windows")
args = p.parse_args()
torch.set_num_threads(1)
model, tok = load_float_model(resolve(DEFAULT_MODEL))
seqs = heldout(tok, args.num_seqs) if not args.select else [
    (s, ids) for s, seed in (("boolq", 1), ("lambada", 0))
    for ids in token_batches(tok, builtin_texts(s, "calib"), args.num_seqs, 512, seed=seed)]
recipe = variant("nvfp4", {}, args.num_samples)
c = recipe.calibration
batches = token_batches(tok, builtin_texts("boolq", "calib"), c.num_samples, c.seq_len, c.seed)
calibrate(model, recipe, batches)
print(f"nvfp4 ({recipe.weight_scale_search} search): ppl {perplexity(model, seqs)}", flush=True)
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402

linears = _nvfp4_weight_linears(model)
hs = {n: torch.zeros(m.in_features, m.in_features) for n, m in linears}


def add(name, x):  # a forward pre-hook must return None, or its value replaces the input
    x = x.reshape(-1, x.shape[-1]).float()
    hs[name].addmm_(x.t(), x, alpha=2.0)


hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: add(n, a[0])) for n, m in linears]
on = [q for q in model.modules() if isinstance(q, TensorQuantizer) and q.is_enabled]
for q in on:
    q.disable()
forward_loop(batches, desc="GPTQ Hessians")(model)
for q in on:
    q.enable()
for h in hooks:
    h.remove()
t0 = time.time()
with torch.no_grad():
    for n, m in linears:
        w = m.weight.data
        m.weight.data.copy_(gptq_nvfp4(w, hs.pop(n), block_scales(w, m.weight_quantizer.amax), args.damp).to(w.dtype))
print(f"GPTQ {time.time() - t0:.0f} s; nvfp4 + GPTQ (damp {args.damp}): ppl {perplexity(model, seqs)}", flush=True)
