"""Experiment: does the AWQ clip search pick better clips with more tokens per forward call (modelopt samples 64)?
AWQ-lite once on the embedded model, then the clip search at each max_tokens_per_batch on a copy; held-out
perplexity of the fake-quantized model (bench/accuracy.py's windows).
Usage: OMP_NUM_THREADS=1 python3 dev/bench/awq_clip_tokens.py [--tokens 64,512,4096] [--num-samples 8]"""
import argparse
import copy
import dataclasses
import time

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.resmooth import share_pre_quant_scales
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe

p = argparse.ArgumentParser()
p.add_argument("--tokens", default="64,512,4096")
p.add_argument("--num-samples", type=int, default=8)
p.add_argument("--alpha-step", type=float, default=0.1)
args = p.parse_args()
model_dir = models.resolve(models.DEFAULT_MODEL)
model, tok = load_float_model(model_dir)
seqs = heldout(tok, 8)
recipe = load_recipe("int4_awq")
recipe = dataclasses.replace(recipe, algorithm="awq_lite", algorithm_args={"alpha_step": args.alpha_step})
c = recipe.calibration
batches = token_batches(tok, builtin_texts("boolq", "calib"), args.num_samples, c.seq_len, c.seed)
t0 = time.time()
calibrate(model, recipe, batches)
share_pre_quant_scales(model)
print(f"awq_lite {time.time() - t0:.0f} s; ppl {perplexity(model, seqs)}", flush=True)
for n in map(int, args.tokens.split(",")):
    m = copy.deepcopy(model)
    t0 = time.time()
    awq_clip_search(m, forward_loop(batches, desc=f"clip {n}"), max_tokens_per_batch=n)
    print(f"max_tokens_per_batch {n}: clip {time.time() - t0:.0f} s; ppl {perplexity(m, seqs)}", flush=True)
