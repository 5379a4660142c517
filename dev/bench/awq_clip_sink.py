"""Experiment: the clip search's token subsample (every (tokens // 64)-th row from row 0, as modelopt's) always holds
each calibration sequence's first token, SmolLM2's attention sink, whose down_proj inputs are 100-1000x the others
(docs/accuracy.md): its squared error outweighs the other 63 tokens. Variants: the shipped rule; the same stride
started half a stride in (never row 0); every row but the first of each sequence, subsampled to the same count.
AWQ-lite once, then each clip search on a copy; held-out perplexity of the fake-quantized model.
Usage: OMP_NUM_THREADS=1 python3 dev/bench/awq_clip_sink.py [--num-samples 8]"""
import argparse
import copy
import time

from lowbit.bench.accuracy import perplexity
from lowbit.calibrate import awq_clip
from lowbit.calibrate.loop import forward_loop

from awq_lite_base import awq_lite_model  # dev/bench, beside this script

p = argparse.ArgumentParser()
p.add_argument("--num-samples", type=int, default=8)
args = p.parse_args()
model, seqs, batches = awq_lite_model(args.num_samples)

original = awq_clip._GroupClip.add


def offset_rows(self, x, max_tokens):
    """The same stride, started half a stride in (the same number of rows)."""
    flat = x.reshape(-1, x.shape[-1])
    stride = max(1, flat.shape[0] // max_tokens)
    rows = flat[stride // 2::stride]
    return original(self, rows, rows.shape[0])


def no_first(self, x, max_tokens):
    """The shipped stride over every row but each sequence's first ([batch, seq, in] inputs)."""
    flat = x.reshape(-1, x.shape[-1])
    stride = max(1, flat.shape[0] // max_tokens)
    rows = (x[:, 1:] if x.dim() == 3 else x[1:]).reshape(-1, x.shape[-1])[0::stride]
    return original(self, rows, rows.shape[0])


for name, add in [("shipped (row 0 on)", original), ("offset by half a stride", offset_rows),
                  ("first token of each sequence left out", no_first)]:
    awq_clip._GroupClip.add = add
    m = copy.deepcopy(model)
    t0 = time.time()
    awq_clip.awq_clip_search(m, forward_loop(batches, desc=f"clip {name}"))
    print(f"{name}: clip {time.time() - t0:.0f} s; ppl {perplexity(m, seqs)}", flush=True)
awq_clip._GroupClip.add = original
