"""Where the NVFP4 activation loss sits: the shipped nvfp4 recipe calibrated once (fake-quant model, 4 x 512
calibration tokens), then held-out perplexity with the NVFP4 input quantizers on for one kind of linear at a time
(weights and KV cache stay quantized), and per-layer with --layers.

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_act_split.py [--layers] [--num-seqs 4]
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
    ap.add_argument("--layers", action="store_true", help="also one layer's inputs at a time (all kinds)")
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

    run("none", lambda n: False)
    run("all", lambda n: True)
    for kind, leaves in KINDS.items():
        run(kind, lambda n, leaves=leaves: n.rsplit(".", 1)[-1] in leaves)
    if a.layers:
        for i in range(model.config.num_hidden_layers):
            run(f"layer {i}", lambda n, i=i: f".layers.{i}." in n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
