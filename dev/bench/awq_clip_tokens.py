"""Experiment: does the AWQ clip search pick better clips with more tokens per forward call (modelopt samples 64)?
AWQ-lite once on the embedded model, then the clip search at each max_tokens_per_batch on a copy; held-out
perplexity of the fake-quantized model (bench/accuracy.py's windows).
Usage: OMP_NUM_THREADS=1 python3 dev/bench/awq_clip_tokens.py [--tokens 64,512,4096] [--num-samples 8]"""
import argparse
import copy
import time

from lowbit.bench.accuracy import perplexity
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.loop import forward_loop

from awq_lite_base import awq_lite_model  # dev/bench, beside this script

p = argparse.ArgumentParser()
p.add_argument("--tokens", default="64,512,4096")
p.add_argument("--num-samples", type=int, default=8)
p.add_argument("--alpha-step", type=float, default=0.1)
args = p.parse_args()
model, seqs, batches = awq_lite_model(args.num_samples, args.alpha_step)
for n in map(int, args.tokens.split(",")):
    m = copy.deepcopy(model)
    t0 = time.time()
    awq_clip_search(m, forward_loop(batches, desc=f"clip {n}"), max_tokens_per_batch=n)
    print(f"max_tokens_per_batch {n}: clip {time.time() - t0:.0f} s; ppl {perplexity(m, seqs)}", flush=True)
