"""Calibration: token batches -> forward passes -> modelopt quantizers with calibrated amax."""
import sys
import time
from contextlib import redirect_stdout

import torch
from tqdm import tqdm

from lowbit.calibrate.configs import modelopt_config
from lowbit.recipe import Recipe

BATCH_SIZE = 4  # sequences per forward pass


def forward_loop(batches: list[list[int]], desc: str = "calibrating"):
    """A modelopt forward_loop over fixed-length token sequences, with a progress bar."""

    def loop(model) -> None:
        device = next(model.parameters()).device
        body = getattr(model, model.base_model_prefix, model)  # skip lm_head: logits are not needed to calibrate
        chunks = [batches[i:i + BATCH_SIZE] for i in range(0, len(batches), BATCH_SIZE)]
        with torch.no_grad():
            for chunk in tqdm(chunks, desc=desc, unit="batch", file=sys.stderr, disable=None):
                body(torch.tensor(chunk, device=device))

    return loop


def calibrate(model, recipe: Recipe, batches: list[list[int]], config: dict | None = None):
    """Insert and calibrate the recipe's quantizers in place; returns the model (now fake-quantized).

    `config` replaces the recipe's modelopt config (bench/accuracy.py passes modelopt's stock config).
    """
    import modelopt.torch.quantization as mtq

    from lowbit.calibrate import nvfp4_cpu
    from lowbit.calibrate.kv import check_kv_calibrated

    t0 = time.time()
    nvfp4_cpu.install()  # CPU kernel for NVFP4 dynamic block quantization; CUDA keeps modelopt's own
    with redirect_stdout(sys.stderr):  # modelopt prints its config and counts: keep stdout for the summary
        cfg = config if config is not None else modelopt_config(recipe, model)
        model = mtq.quantize(model, cfg, forward_loop(batches, desc=f"calibrating {recipe.name}"))
    if recipe.kv_cache:
        check_kv_calibrated(model)
    print(f"[lowbit] calibrated {len(batches)} x {len(batches[0])} tokens in {time.time() - t0:.1f} s", file=sys.stderr)
    return model
