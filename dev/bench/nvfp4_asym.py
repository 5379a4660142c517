"""NVFP4 with each linear's weights corrected for its quantized inputs (dev/bench/nvfp4_asym_correct.py) instead of the
shipped block-scale search alone: the nvfp4 recipe max-calibrated (4 x 512 calibration tokens), then the sequential
correction + search for each damping, measured on the fake-quant model (4 held-out sequences per source).

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_asym.py --damps 0.01 0.1
"""
import argparse
import copy
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
from nvfp4_asym_correct import nvfp4_asym_correct  # noqa: E402
from lowbit.calibrate.nvfp4_clip import _share_weight_amax  # noqa: E402
from lowbit.models import DEFAULT_MODEL, resolve  # noqa: E402
from lowbit.quantize.api import load_float_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--damps", type=float, nargs="+", default=[0.01, 0.1])
    ap.add_argument("--diag", action="store_true", help="one gain per input channel instead of the full regression")
    ap.add_argument("--drift-only", action="store_true", help="regress from the inputs before their NVFP4 rounding")
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    float_model, tok = load_float_model(resolve(DEFAULT_MODEL))
    seqs = heldout(tok, a.num_seqs)
    recipe = variant("nvfp4", {"weight_scale_search": None}, a.num_samples)
    c = recipe.calibration
    batches = token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"), c.num_samples, c.seq_len,
                            c.seed)
    t0 = time.time()
    base = calibrate(copy.deepcopy(float_model), recipe, batches)
    _share_weight_amax(base)
    print(json.dumps({"max_calibrate_s": round(time.time() - t0)}), flush=True)
    for damp in a.damps:
        model = copy.deepcopy(base)
        t0 = time.time()
        nvfp4_asym_correct(model, float_model, batches, damp, a.diag, a.drift_only)
        seconds = time.time() - t0
        ppl = perplexity(model, seqs)
        print(json.dumps({"damp": damp, "diag": a.diag, "drift_only": a.drift_only, "correct_s": round(seconds),
                          **{s: round(x, 3) for s, x in ppl.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
