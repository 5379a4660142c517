"""Experiment: where NVFP4's loss on the embedded model comes from: weights only, activations only, KV only, all.
Fake-quantized model, held-out perplexity on bench/accuracy.py's windows (4 x 512 tokens per source by default).
Usage: OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_split.py [--num-seqs 4]"""
import argparse
import copy
import dataclasses

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.configs import modelopt_config
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe

p = argparse.ArgumentParser()
p.add_argument("--num-seqs", type=int, default=4)
args = p.parse_args()
float_model, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
seqs = heldout(tok, args.num_seqs)
print(f"float ppl {perplexity(float_model, seqs)}", flush=True)
recipe = load_recipe("nvfp4")
c = recipe.calibration
batches = token_batches(tok, builtin_texts("boolq", "calib"), c.num_samples, c.seq_len, c.seed)
for label, off in (("weights only", ("*input_quantizer", "*bmm_quantizer")),
                   ("activations only", ("*weight_quantizer", "*bmm_quantizer")),
                   ("KV only", ("*weight_quantizer", "*input_quantizer"))):
    r = dataclasses.replace(recipe, kv_cache=None) if "*bmm_quantizer" in off else recipe
    cfg = modelopt_config(r, float_model)
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": q, "enable": False} for q in off]
    m = calibrate(copy.deepcopy(float_model), r, batches, config=cfg)
    print(f"nvfp4 {label}: ppl {perplexity(m, seqs)}", flush=True)
