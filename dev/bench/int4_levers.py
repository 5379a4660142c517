"""Experiment (issue 35): levers on top of int4_awq's AWQ-lite + re-smoothing, each on a copy of one AWQ-lite model;
held-out perplexity of the fake-quantized embedded model (bench/accuracy.py's windows) and each step's seconds.
Targets (docs/accuracy.md: float 22.06 / 56.75, int4_rtn 33.34 / 80.07): <= 40 % of RTN's loss = 26.58 / 66.08.
Usage: OMP_NUM_THREADS=1 python3 dev/bench/int4_levers.py [sink-free] clip seqclip clip+gptq:down_proj clip+gptq-static:down_proj"""
import copy
import sys
import time

import torch

from lowbit.bench.accuracy import perplexity
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.gptq import gptq_round
from lowbit.calibrate.loop import forward_loop

from awq_lite_base import awq_lite_model  # dev/bench, beside this script
from int4_sequential import sequential_clip_search
from int4_sink import sink_free_act_scale

FLOAT, RTN = {"boolq": 22.06, "lambada": 56.75}, {"boolq": 33.34, "lambada": 80.07}


def of_rtn(ppl: dict) -> str:
    return " ".join(f"{s} {v:.2f} ({(v / FLOAT[s] - 1) / (RTN[s] / FLOAT[s] - 1):.0%} of RTN)" for s, v in ppl.items())


def step(model, batches, name: str) -> None:
    kind, _, arg = name.partition(":")
    loop = forward_loop(batches, desc=name)
    if kind == "clip":
        awq_clip_search(model, loop)
    elif kind == "seqclip":
        sequential_clip_search(model, batches)
    elif kind in ("gptq", "gptq-static"):
        gptq_round(model, loop, static_groups=kind == "gptq-static", skip=tuple(arg.split(",")) if arg else ())
    else:
        raise SystemExit(f"unknown step {name!r}")


torch.set_num_threads(1)
variants = sys.argv[1:]
if variants[0] == "sink-free":  # AWQ-lite's act_scale without each sequence's first token
    variants = variants[1:]
    with sink_free_act_scale():
        model, seqs, batches = awq_lite_model()
else:
    model, seqs, batches = awq_lite_model()
for variant in variants:
    m = copy.deepcopy(model)
    t0 = time.time()
    for name in variant.split("+"):
        step(m, batches, name)
    print(f"{variant}: {time.time() - t0:.0f} s; {of_rtn(perplexity(m, seqs))}", flush=True)
