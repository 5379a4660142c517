"""Choose the nvfp4 recipe's smoothing_alpha on calibration-split text (never the held-out passages): for each alpha
the shipped recipe (smoothing at that alpha) is calibrated on 8 x 512 BoolQ calibration tokens and measured on
modelopt's fake-quant model over LAMBADA calibration-split windows (a source calibration does not use) and BoolQ
calibration-split windows at another seed.

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_smooth_alpha.py 0.3 0.4 0.5 0.6 0.7     # -1: smoothing off
    RECIPE=fp8 OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_smooth_alpha.py -1 0.5       # another recipe, fold added
    SAMPLES=32 OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_smooth_alpha.py 0.5          # calibration sequences (8)
    STAT=max OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_smooth_alpha.py 0.5 0.3        # max |x| statistic (rms)
"""
import os
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench.accuracy import perplexity  # noqa: E402
from lowbit.bench.accuracy_variants import variant  # noqa: E402
from lowbit.calibrate.data import builtin_texts, token_batches  # noqa: E402
from lowbit.calibrate.loop import calibrate  # noqa: E402
from lowbit.models import DEFAULT_MODEL, resolve  # noqa: E402
from lowbit.quantize.api import load_float_model  # noqa: E402


def main() -> int:
    alphas = [float(a) for a in sys.argv[1:]] or [0.5]
    torch.set_num_threads(1)
    float_model, tok = load_float_model(resolve(DEFAULT_MODEL))
    select = [(s, ids) for s, seed in (("boolq", 1), ("lambada", 0))
              for ids in token_batches(tok, builtin_texts(s, "calib"), 4, 512, seed=seed)]
    print(json.dumps({"alpha": "float", **{s: round(x, 3) for s, x in perplexity(float_model, select).items()}}),
          flush=True)
    for alpha in alphas:
        stat = os.environ.get("STAT", "rms")
        fold = {"smoothing": stat, "smoothing_alpha": alpha} if alpha >= 0 else {"smoothing": None}
        recipe = variant(os.environ.get("RECIPE", "nvfp4"), fold, int(os.environ.get("SAMPLES", 8)))
        c = recipe.calibration
        batches = token_batches(tok, builtin_texts("boolq", "calib"), c.num_samples, c.seq_len, c.seed)
        model = copy.deepcopy(float_model)
        t0 = time.time()
        calibrate(model, recipe, batches)
        ppl = perplexity(model, select)
        print(json.dumps({"alpha": alpha if alpha >= 0 else "off", "calibrate_s": round(time.time() - t0),
                          **{s: round(x, 3) for s, x in ppl.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
