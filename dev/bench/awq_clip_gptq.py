"""Experiment: AWQ-lite + clip search, then GPTQ rounding on every linear except down_proj (whose inputs SmolLM2's
attention-sink token dominates, docs/accuracy.md), against the shipped int4_awq and RTN; held-out perplexity of the
fake-quantized embedded model (bench/accuracy.py's windows).
Usage: OMP_NUM_THREADS=1 python3 dev/bench/awq_clip_gptq.py [--skip down_proj] [--clip-tokens 64]"""
import argparse
import copy
import dataclasses
import time

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate import gptq
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe

p = argparse.ArgumentParser()
p.add_argument("--skip", default="down_proj", help="comma-separated linear names GPTQ leaves alone")
p.add_argument("--clip-tokens", type=int, default=64)
args = p.parse_args()
model_dir = models.resolve(models.DEFAULT_MODEL)
float_model, tok = load_float_model(model_dir)
seqs = heldout(tok, 8)
batches = token_batches(tok, builtin_texts("boolq", "calib"), 8, 512, 0)

rtn = calibrate(copy.deepcopy(float_model), load_recipe("int4_rtn"), batches)
print(f"rtn ppl {perplexity(rtn, seqs)}", flush=True)
del rtn
model = calibrate(float_model, dataclasses.replace(load_recipe("int4_awq"), algorithm="awq_lite"), batches)
t0 = time.time()
awq_clip_search(model, forward_loop(batches, desc="clip"), max_tokens_per_batch=args.clip_tokens)
print(f"awq_full (clip {args.clip_tokens}) ppl {perplexity(model, seqs)}", flush=True)
everything = gptq.quantized_linears
skip = tuple(args.skip.split(",")) if args.skip else ()
for label, keep in (("gptq except " + args.skip, lambda n: not n.endswith(skip)), ("gptq all", lambda n: True)):
    m = copy.deepcopy(model)
    gptq.quantized_linears = lambda mod: [(n, x) for n, x in everything(mod) if keep(n)]
    t0 = time.time()
    gptq.gptq_round(m, forward_loop(batches, desc="GPTQ Hessians"), static_groups=True)
    print(f"awq_full + {label}: {time.time() - t0:.0f} s, ppl {perplexity(m, seqs)}", flush=True)
