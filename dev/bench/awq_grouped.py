"""Experiment: AWQ scales searched per group of linears that read one input (q/k/v, gate/up; o_proj and down_proj
alone), one alpha per group on the concatenated output error, instead of modelopt's AWQ-lite (one alpha per linear,
whose scales export then averages within each group). Then lowbit's clip search, as awq_full does. Held-out
perplexity of the fake-quantized embedded model (bench/accuracy.py's windows).
Usage: OMP_NUM_THREADS=1 python3 dev/bench/awq_grouped.py [--tokens 512] [--alpha-step 0.1]"""
import argparse
import dataclasses
import time
from collections import defaultdict

import torch

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=512, help="tokens per forward call the search scores")
p.add_argument("--alpha-step", type=float, default=0.1)
args = p.parse_args()


def linears(model):
    return {n: m for n, m in model.named_modules()
            if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled and m.weight.dim() == 2}


def groups_by_input(model, mods, ids):
    seen = defaultdict(list)
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen[(a[0].data_ptr(), tuple(a[0].shape), n.rsplit('.', 2)[0])].append(n)) for n, m in mods.items()]
    with torch.no_grad():
        model(torch.tensor([ids[:32]]))
    for h in hooks:
        h.remove()
    return list(seen.values())


def group_weight_scale(ws, group):
    """modelopt's get_weight_scale over the group's rows together: mean over rows of |w| / its block's max."""
    w = torch.cat(ws).float()
    b = w.reshape(-1, group).abs()
    return (b / (b.amax(1, keepdim=True) + 1e-38)).reshape(w.shape).mean(0)


def get_scale(act, wsc, alpha):
    s = (act.pow(alpha) / (wsc.pow(1 - alpha) + 1e-38)).clamp(1e-4, 1e4)
    return s / (s.max() * s.min()).sqrt()


def quantized(mod, w):
    """w fake-quantized by mod's weight quantizer at max-calibrated amax (modelopt's own int4 rounding)."""
    wq = mod.weight_quantizer
    group = wq.block_sizes[-1]
    wq.amax = w.reshape(-1, group).abs().amax(-1, keepdim=True).reshape(wq.amax.shape)
    return wq(w)


model_dir = models.resolve(models.DEFAULT_MODEL)
model, tok = load_float_model(model_dir)
seqs = heldout(tok, 8)
batches = token_batches(tok, builtin_texts("boolq", "calib"), 8, 512, 0)
t0 = time.time()
model = calibrate(model, dataclasses.replace(load_recipe("int4_awq"), algorithm="rtn", algorithm_args={}), batches)
mods = linears(model)
groups = groups_by_input(model, mods, batches[0])
for m in mods.values():
    m.weight_quantizer.disable()  # float forward for statistics and inputs, as AWQ-lite's
alphas = [round(a, 3) for a in torch.arange(0, 1 + args.alpha_step / 2, args.alpha_step).tolist()]
act = {g[0]: 0 for g in groups}
calls = defaultdict(int)


def act_hook(name):
    def hook(mod, a):
        x = a[0].reshape(-1, a[0].shape[-1]).float()
        act[name] = act[name] + x.abs().mean(0)
        calls[name] += 1
    return hook


hooks = [mods[g[0]].register_forward_pre_hook(act_hook(g[0])) for g in groups]
forward_loop(batches, desc="AWQ statistics")(model)
for h in hooks:
    h.remove()
wscale = {g[0]: group_weight_scale([mods[n].weight.detach() for n in g], mods[g[0]].weight_quantizer.block_sizes[-1])
          for g in groups}
loss = {g[0]: torch.zeros(len(alphas), dtype=torch.float64) for g in groups}


def search_hook(g):
    def hook(mod, a):
        x = a[0].reshape(-1, a[0].shape[-1]).float()
        x = x[0::max(1, x.shape[0] // args.tokens)]
        w = torch.cat([mods[n].weight.detach().float() for n in g])
        ref = x @ w.t()
        for i, alpha in enumerate(alphas):
            s = get_scale(act[g[0]] / calls[g[0]], wscale[g[0]], alpha)
            for m in (mods[n] for n in g):
                m.weight_quantizer.enable()
            wq = torch.cat([quantized(mods[n], mods[n].weight.detach().float() * s) for n in g])
            for m in (mods[n] for n in g):
                m.weight_quantizer.disable()
            loss[g[0]][i] += ((x / s) @ wq.t() - ref).pow(2).mean().double()
    return hook


hooks = [mods[g[0]].register_forward_pre_hook(search_hook(g)) for g in groups]
with torch.no_grad():
    forward_loop(batches, desc="AWQ grouped search")(model)
for h in hooks:
    h.remove()
from modelopt.torch.quantization.model_calib import apply_pre_quant_scale_and_smooth

picked = []
for g in groups:
    best = int(loss[g[0]].argmin())
    picked.append(alphas[best])
    s = get_scale(act[g[0]] / calls[g[0]], wscale[g[0]], alphas[best])
    for n in g:
        mods[n].weight_quantizer.enable()
        apply_pre_quant_scale_and_smooth(mods[n], (1 / s).to(mods[n].weight.dtype))
print(f"grouped AWQ scales {time.time() - t0:.0f} s; alphas {picked}", flush=True)
print(f"grouped AWQ, max amax: ppl {perplexity(model, seqs)}", flush=True)
t0 = time.time()
from lowbit.calibrate.resmooth import share_pre_quant_scales

share_pre_quant_scales(model)
print(f"after export's re-smoothing (a no-op expected): ppl {perplexity(model, seqs)}", flush=True)
awq_clip_search(model, forward_loop(batches, desc="clip"))
print(f"grouped AWQ + clip ({time.time() - t0:.0f} s): ppl {perplexity(model, seqs)}", flush=True)
