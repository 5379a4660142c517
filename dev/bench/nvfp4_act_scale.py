"""NVFP4 activations' per-tensor (global) scale: does a multiple of the calibrated input amax do better than max?
The shipped nvfp4 recipe calibrated once on the fake-quant model, then every NVFP4 input quantizer's amax times m for
each m, held-out perplexity per source (lowbit.bench.accuracy's windows).

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_act_scale.py [--mults 0.25 0.5 1 2 4] [--num-seqs 4]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench.accuracy import heldout, perplexity  # noqa: E402
from lowbit.bench.accuracy_variants import variant  # noqa: E402
from lowbit.calibrate.data import builtin_texts, token_batches  # noqa: E402
from lowbit.calibrate.loop import calibrate  # noqa: E402
from lowbit.models import DEFAULT_MODEL, resolve  # noqa: E402
from lowbit.quantize.api import load_float_model  # noqa: E402


def nvfp4_input_quantizers(model) -> list:
    out = []
    for m in model.modules():
        q = getattr(m, "input_quantizer", None)
        if q is not None and q.is_enabled and q.block_sizes and q.num_bits == (2, 1):
            out.append(q)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mults", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    recipe = variant("nvfp4", {}, a.num_samples)
    model, tok = load_float_model(resolve(DEFAULT_MODEL))
    seqs = heldout(tok, a.num_seqs)
    c = recipe.calibration
    t0 = time.time()
    calibrate(model, recipe, token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"),
                                           c.num_samples, c.seq_len, c.seed))
    quantizers = nvfp4_input_quantizers(model)
    base = [q.amax.clone() for q in quantizers]
    print(json.dumps({"calibrate_s": round(time.time() - t0), "nvfp4_input_quantizers": len(quantizers)}), flush=True)
    for m in a.mults:
        for q, amax in zip(quantizers, base):
            q.amax = amax * m
        ppl = perplexity(model, seqs)
        print(json.dumps({"input_amax_x": m, **{s: round(v, 3) for s, v in ppl.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
