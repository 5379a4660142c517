"""Experiment: modelopt's export averages the AWQ pre_quant_scale of linears that share an input (q/k/v, gate/up) and
re-runs max calibration on each rescaled weight, which drops the clip search's amax there. Held-out perplexity of
the fake-quantized embedded model: AWQ-lite + clip (what calibration ends with), then the same after the export's
re-smoothing (what the checkpoint holds), then re-smoothing first and the clip search after it.
Usage: OMP_NUM_THREADS=1 python3 dev/bench/awq_clip_order.py"""
import copy
import dataclasses

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.awq_clip import awq_clip_search
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.resmooth import share_pre_quant_scales
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe

model, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
seqs = heldout(tok, 8)
batches = token_batches(tok, builtin_texts("boolq", "calib"), 8, 512, 0)
model = calibrate(model, dataclasses.replace(load_recipe("int4_awq"), algorithm="awq_lite"), batches)
clip_then_share = copy.deepcopy(model)
awq_clip_search(clip_then_share, forward_loop(batches, desc="clip"))
print(f"awq_lite + clip: ppl {perplexity(clip_then_share, seqs)}", flush=True)
share_pre_quant_scales(clip_then_share)
print(f"awq_lite + clip, then re-smoothed as export does: ppl {perplexity(clip_then_share, seqs)}", flush=True)
share_pre_quant_scales(model)
print(f"awq_lite, re-smoothed (max amax): ppl {perplexity(model, seqs)}", flush=True)
awq_clip_search(model, forward_loop(batches, desc="clip"))
print(f"awq_lite, re-smoothed, then clip: ppl {perplexity(model, seqs)}", flush=True)
share_pre_quant_scales(model)
print(f"... and export's re-smoothing again (a no-op expected): ppl {perplexity(model, seqs)}", flush=True)
