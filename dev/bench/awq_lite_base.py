"""Shared start of the AWQ clip experiments (awq_clip_tokens.py, awq_clip_sink.py): the embedded model after
int4_awq's AWQ-lite and export's re-smoothing, its calibration batches and bench/accuracy.py's held-out windows."""
import dataclasses
import time

from lowbit import models
from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.loop import calibrate
from lowbit.calibrate.resmooth import share_pre_quant_scales
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe


def awq_lite_model(num_samples: int = 8, alpha_step: float = 0.1):
    """-> (model, held-out sequences, calibration batches); prints the AWQ-lite time and perplexity."""
    model, tok = load_float_model(models.resolve(models.DEFAULT_MODEL))
    seqs = heldout(tok, 8)
    recipe = load_recipe("int4_awq")
    recipe = dataclasses.replace(recipe, algorithm="awq_lite", algorithm_args={"alpha_step": alpha_step})
    c = recipe.calibration
    batches = token_batches(tok, builtin_texts("boolq", "calib"), num_samples, c.seq_len, c.seed)
    t0 = time.time()
    calibrate(model, recipe, batches)
    share_pre_quant_scales(model)
    print(f"awq_lite {time.time() - t0:.0f} s; ppl {perplexity(model, seqs)}", flush=True)
    return model, seqs, batches
