"""NVFP4 with per-channel smoothing folded into the float weights (dev/bench/nvfp4_smooth_fold.py): for each
variant the float model is smoothed (float logits checked against the original), calibrated with the shipped nvfp4
recipe (4 x 512 calibration tokens) and measured on the fake-quant model (4 held-out sequences per source).

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_smooth.py '[{"alpha": 0.5}, {"alpha": 0.3, "groups": ["down"]}]'
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
from lowbit.calibrate.loop import calibrate, forward_loop  # noqa: E402
from nvfp4_smooth_fold import GROUPS, reorder, smooth  # noqa: E402
from lowbit.models import DEFAULT_MODEL, resolve  # noqa: E402
from lowbit.quantize.api import load_float_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", help='JSON list of {"alpha", "groups", "stat", "permute": [o, down], "recipe": {overrides}}')
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    float_model, tok = load_float_model(resolve(DEFAULT_MODEL))
    seqs = heldout(tok, a.num_seqs)
    probe = torch.tensor([seqs[0][1][:128]])
    with torch.no_grad():
        ref = float_model(probe).logits
    for v in json.loads(a.variants):
        recipe = variant("nvfp4", v.get("recipe", {}), a.num_samples)
        c = recipe.calibration
        batches = token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"), c.num_samples,
                                c.seq_len, c.seed)
        model = copy.deepcopy(float_model)
        t0 = time.time()
        if v.get("alpha") is not None:
            smooth(model, forward_loop(batches, "smoothing stats"), v["alpha"], v.get("groups", GROUPS),
                   v.get("stat", "max"))
        if v.get("permute"):
            reorder(model, forward_loop(batches, "reorder stats"), v["permute"])
        with torch.no_grad():
            err = ((model(probe).logits - ref).norm() / ref.norm()).item()
        calibrate(model, recipe, batches)
        seconds = time.time() - t0
        ppl = perplexity(model, seqs)
        print(json.dumps({**v, "float_rel_l2": float(f"{err:.1e}"), "calibrate_s": round(seconds),
                          **{s: round(x, 3) for s, x in ppl.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
