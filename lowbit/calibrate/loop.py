"""Calibration: token batches -> forward passes -> modelopt quantizers with calibrated amax."""
import sys
import time
from contextlib import redirect_stdout

import torch

from lowbit.calibrate.configs import modelopt_config
from lowbit.progress import Progress
from lowbit.recipe import Recipe

BATCH_SIZE = 4  # sequences per forward pass


def forward_loop(batches: list[list[int]], desc: str = "calibrating", later_passes: str = "pass"):
    """A modelopt forward_loop over fixed-length token sequences, with progress per batch and per decoder layer.

    modelopt may call it more than once (AWQ: activation statistics, then the scale search, which is slow per
    layer); call k > 1 is shown as `desc, <later_passes> k`. Progress counts decoder layers (forward hooks on
    `body.layers`), so a long per-layer search still shows movement within one batch.
    """
    calls = [0]

    def loop(model) -> None:
        device = next(model.parameters()).device
        body = getattr(model, model.base_model_prefix, model)  # skip lm_head: logits are not needed to calibrate
        chunks = [batches[i:i + BATCH_SIZE] for i in range(0, len(batches), BATCH_SIZE)]
        calls[0] += 1
        name = desc if calls[0] == 1 else f"{desc}, {later_passes} {calls[0]}"
        layers = list(getattr(body, "layers", None) or [])
        per_batch = max(len(layers), 1)
        with Progress(len(chunks) * per_batch, name, "layers" if layers else "batches") as bar:
            hooks = [layer.register_forward_hook(lambda *_: bar.update()) for layer in layers]
            try:
                with torch.no_grad():
                    for b, chunk in enumerate(chunks):
                        bar.describe(f"{name}, batch {b + 1}/{len(chunks)}")
                        body(torch.tensor(chunk, device=device))
                        if not layers:
                            bar.update()
            finally:
                for h in hooks:
                    h.remove()

    return loop


def calibrate(model, recipe: Recipe, batches: list[list[int]], config: dict | None = None):
    """Insert and calibrate the recipe's quantizers in place (after the recipe's rotation and smoothing fold, if
    any, on the float weights); returns the model (now fake-quantized).

    `config` replaces the recipe's modelopt config (bench/accuracy.py passes modelopt's stock config).
    """
    import modelopt.torch.quantization as mtq

    from lowbit.calibrate import nvfp4_cpu
    from lowbit.calibrate.kv import check_kv_calibrated

    t0 = time.time()
    if recipe.rotation and config is None:
        from lowbit.calibrate.rotate import rotate

        rotate(model, **recipe.rotation_args)
        print(f"[lowbit] rotation {recipe.rotation} folded into the weights in {time.time() - t0:.1f} s", file=sys.stderr)
    if recipe.smoothing and config is None:
        from lowbit.calibrate.smooth import smooth

        t1 = time.time()
        smooth(model, forward_loop(batches, desc=f"smoothing statistics {recipe.name}"), recipe.smoothing_alpha,
               recipe.smoothing)
        print(f"[lowbit] smoothing ({recipe.smoothing}, alpha {recipe.smoothing_alpha}) folded into the weights in "
              f"{time.time() - t1:.1f} s", file=sys.stderr)
    nvfp4_cpu.install()  # CPU kernel for NVFP4 dynamic block quantization; CUDA keeps modelopt's own
    with redirect_stdout(sys.stderr):  # modelopt prints its config and counts: keep stdout for the summary
        cfg = config if config is not None else modelopt_config(recipe, model)
        own_clip = config is None and _clip_search_is_lowbits(recipe)
        if own_clip:  # modelopt runs awq_full's first half (its config refuses the clip keys), awq_clip.py the second
            from lowbit.calibrate.awq_clip import CLIP_ARGS

            lite = {k: v for k, v in cfg["algorithm"].items() if k not in CLIP_ARGS}
            cfg["algorithm"] = lite | {"method": "awq_lite"}
        # AWQ-lite's scale search (one forward per alpha per linear) is the slow pass: it may see only the first
        # sequences (awq_lite_samples, at most all of them), the passes after it (clip search, GPTQ) all of them
        first = batches[:recipe.algorithm_args.get("awq_lite_samples", len(batches))] if config is None else batches
        model = mtq.quantize(model, cfg, forward_loop(first, desc=f"calibrating {recipe.name}",
                                                    later_passes=f"{recipe.algorithm} pass"))
        if own_clip:
            from lowbit.calibrate.awq_clip import awq_clip_search
            from lowbit.calibrate.resmooth import share_pre_quant_scales

            # export gives linears that share an input one pre_quant_scale and max-calibrates each weight it
            # rescales: done first, so the clips are searched on the weights the checkpoint holds
            share_pre_quant_scales(model)
            args = {k: v for k, v in recipe.algorithm_args.items() if k in CLIP_ARGS}
            joint = recipe.algorithm_args.get("joint_clip")
            if joint:  # its Hessians come from the clip search's pass
                from lowbit.calibrate.joint_clip import input_hessians, joint_clip_refine

                hessians = input_hessians(model, recipe.algorithm_args.get("joint_clip_skip", ()))
            try:
                awq_clip_search(model, forward_loop(batches, desc=f"AWQ clip search {recipe.name}"), **args)
            finally:
                if joint:
                    hessians.remove()
            if joint:
                t1 = time.time()
                grid = {k: v for k, v in args.items() if k != "max_tokens_per_batch"}
                changed, total = joint_clip_refine(model, hessians, **grid)
                print(f"[lowbit] joint clip refinement: {changed} of {total} groups moved ({time.time() - t1:.1f} s)",
                      file=sys.stderr)
        if recipe.rounding == "gptq" and config is None:
            from lowbit.calibrate.gptq import gptq_round

            gptq_round(model, forward_loop(batches, desc=f"GPTQ Hessians {recipe.name}"), **recipe.rounding_args)
        if recipe.weight_scale_search and config is None:
            from lowbit.calibrate.nvfp4_clip import nvfp4_weight_scale_search

            t1 = time.time()
            n = nvfp4_weight_scale_search(model, forward_loop(batches, desc=f"NVFP4 weight statistics {recipe.name}"),
                                          recipe.weight_scale_search)
            print(f"[lowbit] NVFP4 weight scale search ({recipe.weight_scale_search}): {n} blocks clipped "
                  f"({time.time() - t1:.1f} s)", file=sys.stderr)
    if recipe.kv_cache:
        check_kv_calibrated(model)
    if recipe.kv_scale_search and config is None:
        from lowbit.calibrate.kv import search_kv_scales

        t1 = time.time()
        ck, cv = search_kv_scales(model, batches)
        print(f"[lowbit] KV scale search: k amax x {ck}, v amax x {cv} ({time.time() - t1:.1f} s)", file=sys.stderr)
    print(f"[lowbit] calibrated {len(batches)} x {len(batches[0])} tokens in {time.time() - t0:.1f} s", file=sys.stderr)
    return model


def _clip_search_is_lowbits(recipe: Recipe) -> bool:
    """awq_full's clip search runs as lowbit's faster equivalent where the weights are the only quantized tensors
    (the W4A16 formats AWQ applies to, no KV-cache quantizers, whose calibration modelopt's pass would redo)."""
    return recipe.algorithm == "awq_full" and not recipe.kv_cache
