"""Where the NVFP4 activation loss sits: the shipped nvfp4 recipe calibrated once (fake-quant model, 4 x 512
calibration tokens), then held-out perplexity with the NVFP4 input quantizers on for one kind of linear at a time
(weights and KV cache stay quantized), and per band of layers with --band.

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_act_split.py [--band 5] [--no-kinds] [--num-seqs 4]
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

KINDS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--band", type=int, default=0, help="also the inputs of BAND consecutive layers at a time")
    ap.add_argument("--no-kinds", action="store_true", help="skip the per-kind rows")
    a = ap.parse_args()
    torch.set_num_threads(1)
    recipe = variant("nvfp4", {}, a.num_samples)
    model, tok = load_float_model(resolve(DEFAULT_MODEL))
    seqs = heldout(tok, a.num_seqs)
    c = recipe.calibration
    t0 = time.time()
    calibrate(model, recipe, token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"),
                                           c.num_samples, c.seq_len, c.seed))
    inputs = {name: m.input_quantizer for name, m in model.named_modules()
              if getattr(m, "input_quantizer", None) is not None and m.input_quantizer.is_enabled
              and m.input_quantizer.block_sizes}
    print(json.dumps({"calibrate_s": round(time.time() - t0), "nvfp4_inputs": len(inputs)}), flush=True)

    def run(label, on):
        for name, q in inputs.items():
            q.enable() if on(name) else q.disable()
        ppl = perplexity(model, seqs)
        print(json.dumps({"inputs_on": label, **{s: round(v, 3) for s, v in ppl.items()}}), flush=True)

    if not a.no_kinds:
        run("none", lambda n: False)
        run("all", lambda n: True)
        for kind, leaves in KINDS.items():
            run(kind, lambda n, leaves=leaves: n.rsplit(".", 1)[-1] in leaves)
    for lo in range(0, model.config.num_hidden_layers, a.band or model.config.num_hidden_layers + 1):
        band = range(lo, min(lo + a.band, model.config.num_hidden_layers))
        run(f"layers {band.start}-{band.stop - 1}", lambda n, band=band: int(n.split(".layers.")[1].split(".")[0]) in band)
    return 0


if __name__ == "__main__":
    sys.exit(main())
