"""Experiment: NVFP4 weight block-scale search (calibrate/nvfp4_clip.py) with only the weights quantized, beside
plain max block scales: how much of the weights' share of NVFP4's loss (dev/bench/nvfp4_split.py) it removes.
Fake-quantized model, held-out perplexity on bench/accuracy.py's windows (4 x 512 tokens per source by default).
Usage: OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 dev/bench/nvfp4_clip_split.py [--num-seqs 4] [--errors none,mse,output]"""
import argparse
import copy
import dataclasses

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.configs import modelopt_config
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.loop import calibrate, forward_loop
from lowbit.calibrate.nvfp4_clip import nvfp4_weight_scale_search
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe

p = argparse.ArgumentParser()
p.add_argument("--num-seqs", type=int, default=4)
p.add_argument("--errors", default="none,mse,output")
args = p.parse_args()
float_model, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
seqs = heldout(tok, args.num_seqs)
recipe = dataclasses.replace(load_recipe("nvfp4"), kv_cache=None, weight_scale_search=None)
c = recipe.calibration
batches = token_batches(tok, builtin_texts("boolq", "calib"), c.num_samples, c.seq_len, c.seed)
cfg = modelopt_config(recipe, float_model)
cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": q, "enable": False}
                                             for q in ("*input_quantizer", "*bmm_quantizer")]
for error in args.errors.split(","):
    m = calibrate(copy.deepcopy(float_model), recipe, batches, config=cfg)
    if error != "none":
        nvfp4_weight_scale_search(m, forward_loop(batches, desc="weight statistics"), error)
    print(f"nvfp4 weights only, block scales {error if error != 'none' else 'max'}: ppl {perplexity(m, seqs)}", flush=True)
