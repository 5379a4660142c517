"""Fast accuracy exploration: a recipe with overrides, calibrated, measured on modelopt's fake-quant model (no export).

Prints one JSON row: held-out perplexity per source (bench/accuracy.py's windows) and calibration seconds.

    python3 -m lowbit.bench.accuracy_variants fp8 '{"kv_cache": null}' --num-seqs 4 --num-samples 4
    python3 -m lowbit.bench.accuracy_variants int4_rtn '{}' --fold-norms     # norms folded, no rotation
    python3 -m lowbit.bench.accuracy_variants fp8 '{}' --kv-scale 2 1        # k amax x 2 after calibration
    python3 -m lowbit.bench.accuracy_variants nvfp4 '{}' --rotate-heads      # value heads rotated, residual not
"""
import argparse
import json
import time

import torch

from lowbit.bench.accuracy import heldout, perplexity
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.calibrate.kv import kv_quantizers
from lowbit.calibrate.loop import calibrate
from lowbit.calibrate.rotate import fold_norms, rotate_heads
from lowbit.models import DEFAULT_MODEL, resolve
from lowbit.quantize.api import load_float_model
from lowbit.recipe import load_recipe, recipe_from_dict


def variant(name: str, overrides: dict, num_samples: int):
    d = {**load_recipe(name).to_dict(), **overrides}
    d["calibration"] = {**d["calibration"], "num_samples": num_samples}
    return recipe_from_dict(d, source=f"{name} + {json.dumps(overrides)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="?", default="{}", help="JSON object of recipe keys to replace")
    p.add_argument("--num-seqs", type=int, default=4, help="held-out sequences of 512 tokens per source")
    p.add_argument("--num-samples", type=int, default=4, help="calibration sequences")
    p.add_argument("--fold-norms", action="store_true", help="fold RMSNorm weights into the linears first")
    p.add_argument("--rotate-heads", action="store_true", help="rotate each value head only (no norm fold)")
    p.add_argument("--kv-scale", type=float, nargs=2, metavar=("K", "V"), help="k/v amax multipliers after calibration")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    overrides = json.loads(args.overrides)
    recipe = variant(args.recipe, overrides, args.num_samples)
    model, tok = load_float_model(resolve(DEFAULT_MODEL))
    seqs = heldout(tok, args.num_seqs)
    c = recipe.calibration
    t0 = time.time()
    if args.fold_norms:
        fold_norms(model)
    if args.rotate_heads:
        rotate_heads(model)
    calibrate(model, recipe, token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"),
                                           c.num_samples, c.seq_len, c.seed))
    seconds = time.time() - t0
    if args.kv_scale:
        for k, v in kv_quantizers(model).values():
            k.amax, v.amax = k.amax * args.kv_scale[0], v.amax * args.kv_scale[1]
    ppl = perplexity(model, seqs)
    print(json.dumps({"recipe": args.recipe, "overrides": overrides, "fold_norms": args.fold_norms, "rotate_heads": args.rotate_heads,
                      "kv_scale": args.kv_scale, "num_seqs": args.num_seqs, "num_samples": args.num_samples,
                      "calibrate_s": round(seconds), **{s: round(v, 3) for s, v in ppl.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
