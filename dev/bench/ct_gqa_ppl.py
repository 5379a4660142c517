"""Held-out perplexity of a recipe's compressed-tensors export vs its modelopt checkpoint, one calibration, on the
embedded SmolLM2-135M (grouped-query attention: o_proj re-smoothed per KV group for compressed-tensors only).

    PYTHONPATH=$PWD python3 dev/bench/ct_gqa_ppl.py --recipes int4_awq,w8a8_sq --num-samples 4 --num-seqs 4
"""
import argparse
import copy
import dataclasses
import platform
import sys
import tempfile
import time
from pathlib import Path

from lowbit import models
from lowbit.bench.accuracy import SOURCES, heldout, perplexity
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.recipe import load_recipe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="int4_awq,w8a8_sq")
    p.add_argument("--num-samples", type=int, default=4, help="calibration sequences (x the recipe's seq_len)")
    p.add_argument("--num-seqs", type=int, default=4, help="held-out sequences of 512 tokens per source")
    args = p.parse_args(argv)
    from lowbit.calibrate.loop import calibrate
    from lowbit.checkpoint.reference import load_reference_model
    from lowbit.quantize.api import load_float_model
    from lowbit.quantize.export import export

    model_dir = models.resolve(models.DEFAULT_MODEL)
    model, tok = load_float_model(model_dir)
    seqs = heldout(tok, args.num_seqs)
    rows = [("unquantized (fp32)", "-", perplexity(model, seqs))]
    for name in args.recipes.split(","):
        recipe = load_recipe(name)
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration,
                                                                             num_samples=args.num_samples))
        model, tok = load_float_model(model_dir)
        c = recipe.calibration
        batches = token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"), c.num_samples,
                                c.seq_len, c.seed)
        calibrate(model, recipe, batches)
        twin = copy.deepcopy(model)
        with tempfile.TemporaryDirectory() as tmp:
            for layout, m in (("modelopt", model), ("compressed-tensors", twin)):
                out = Path(tmp) / layout
                export(m, tok, recipe, out, source=str(model_dir), export_format=layout)
                rows.append((name, layout, perplexity(load_reference_model(out)[0], seqs)))
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"python3 dev/bench/ct_gqa_ppl.py {' '.join(argv or sys.argv[1:])}; {platform.processor() or platform.machine()}"
          f" CPU, {time.strftime('%Y-%m-%d', time.gmtime())}; calibration {args.num_samples} x 512 tokens, held-out "
          f"{args.num_seqs} x 512 tokens per source")
    print("| recipe | layout | " + " | ".join(f"{s} ppl" for s in SOURCES) + " |")
    print("|---|---|" + "---|" * len(SOURCES))
    for name, layout, ppl in rows:
        print(f"| {name} | {layout} | " + " | ".join(f"{ppl[s]:.3f}" for s in SOURCES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
