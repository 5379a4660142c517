"""Experiment (issue 35): levers on top of int4_awq's AWQ-lite + re-smoothing, each on a copy of one AWQ-lite model;
held-out perplexity of the fake-quantized embedded model (bench/accuracy.py's windows) and each step's seconds.
Targets (docs/accuracy.md: float 22.06 / 56.75, int4_rtn 33.34 / 80.07): <= 40 % of RTN's loss = 26.58 / 66.08.
A variant is steps joined by '+', a step `kind[:key=value...]`: clip, seqclip (tokens=, min=, step=, n=
calibration sequences), jclip / jclip-float (calibrate/joint_clip.py, Hessians from the quantized / float model; skip=, n=), gptq / gptq-static (skip=a,b, damp=, n=). The AWQ-lite model is cached (modelopt's
save/restore) in --cache.
Usage: OMP_NUM_THREADS=1 python3 dev/bench/int4_levers.py [--sink-free] clip seqclip clip:n=32 clip+gptq:skip=down_proj"""
import argparse
import contextlib
import copy
import os
import time

import modelopt.torch.opt as mto
import torch

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.gptq import gptq_round, quantized_linears
from lowbit.calibrate.joint_clip import input_hessians, joint_clip_refine
from lowbit.calibrate.loop import forward_loop
from lowbit.quantize.api import load_float_model

from awq_lite_base import awq_lite_model  # dev/bench, beside this script
from int4_sequential import sequential_clip_search
from int4_sink import sink_free_act_scale

FLOAT, RTN = {"boolq": 22.06, "lambada": 56.75}, {"boolq": 33.34, "lambada": 80.07}


def of_rtn(ppl: dict) -> str:
    return " ".join(f"{s} {v:.2f} ({(v / FLOAT[s] - 1) / (RTN[s] / FLOAT[s] - 1):.0%} of RTN)" for s, v in ppl.items())


def float_weights(loop):
    """forward_loop with every weight quantizer off during the pass."""
    def run(model):
        quantizers = [m.weight_quantizer for _, m in quantized_linears(model)]
        for q in quantizers:
            q.disable()
        try:
            loop(model)
        finally:
            for q in quantizers:
                q.enable()
    return run


def step(model, tok, name: str) -> None:
    kind, *pairs = name.split(":")
    a = dict(p.split("=") for p in pairs)
    batches = token_batches(tok, builtin_texts("boolq", "calib"), int(a.get("n", 8)), 512, 0)
    clip = {"max_tokens_per_batch": int(a.get("tokens", 64)), "min_clip_ratio": float(a.get("min", 0.5)),
            "shrink_step": float(a.get("step", 0.05))}
    if kind == "clip":
        awq_clip_search(model, forward_loop(batches, desc=name), **clip)
    elif kind == "seqclip":
        sequential_clip_search(model, batches, **clip)
    elif kind in ("jclip", "jclip-float"):  # Hessians from the quantized / the float model's inputs
        hessians = input_hessians(model, tuple(a["skip"].split(",")) if "skip" in a else ())
        loop = forward_loop(batches, desc=name)
        try:
            (float_weights(loop) if kind == "jclip-float" else loop)(model)
        finally:
            hessians.remove()
        print(joint_clip_refine(model, hessians, clip["min_clip_ratio"], clip["shrink_step"]), flush=True)
    elif kind in ("gptq", "gptq-static"):
        gptq_round(model, forward_loop(batches, desc=name), damp=float(a.get("damp", 0.01)),
                   static_groups=kind == "gptq-static", skip=tuple(a["skip"].split(",")) if "skip" in a else ())
    else:
        raise SystemExit(f"unknown step {name!r}")


p = argparse.ArgumentParser()
p.add_argument("variants", nargs="+")
p.add_argument("--sink-free", action="store_true", help="AWQ-lite's act_scale without each sequence's first token")
p.add_argument("--cache", default="/tmp/int4/awq_lite_base.pt")
args = p.parse_args()
torch.set_num_threads(1)
if os.path.exists(args.cache) and not args.sink_free:
    float_model, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
    model, seqs = mto.restore(float_model, args.cache), heldout(tok, 8)
else:
    with sink_free_act_scale() if args.sink_free else contextlib.nullcontext():
        model, seqs, _ = awq_lite_model()
    if not args.sink_free:
        mto.save(model, args.cache)
    _, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
for variant in args.variants:
    m = copy.deepcopy(model)
    t0 = time.time()
    for name in variant.split("+"):
        step(m, tok, name)
    print(f"{variant}: {time.time() - t0:.0f} s; {of_rtn(perplexity(m, seqs))}", flush=True)
