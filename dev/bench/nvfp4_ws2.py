"""NVFP4 weight_scale_2 searched with the block scales: the per-tensor weight amax (shared by the linears that read
one input) times m <= 1 for m in a grid (every weight clamped to m x amax first), each block's scale then searched as
the shipped `weight_scale_search: output` does; per group the m with the lowest summed E[x^2]-weighted error is kept.
Fake-quant model, nvfp4 recipe, 4 x 512 calibration tokens, 4 held-out sequences per source.

    OMP_NUM_THREADS=1 python3 dev/bench/nvfp4_ws2.py --mults 1 0.97 0.94 0.91
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench.accuracy import heldout, perplexity  # noqa: E402
from lowbit.bench.accuracy_variants import variant  # noqa: E402
from lowbit.calibrate import nvfp4_clip as nc  # noqa: E402
from lowbit.calibrate.data import builtin_texts, token_batches  # noqa: E402
from lowbit.calibrate.loop import calibrate, forward_loop  # noqa: E402
from lowbit.models import DEFAULT_MODEL, resolve  # noqa: E402
from lowbit.quantize.api import load_float_model  # noqa: E402


def group_loss(ws, amax, sqs, m):
    gs = amax * m / (nc.E2M1_MAX * nc.E4M3_MAX)
    total = 0.0
    for w, sq in zip(ws, sqs):
        _, losses = nc.block_errors(w, gs, sq)
        best = losses.min(0).values
        holds = w.float().reshape(w.shape[0], -1, nc.BLOCK).abs().amax(-1) >= amax * m
        total += float(torch.where(holds, losses[0], best).sum())
    return total


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mults", type=float, nargs="+", default=[1.0, 0.97, 0.94, 0.91])
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_float_model(resolve(DEFAULT_MODEL))
    seqs = heldout(tok, a.num_seqs)
    recipe = variant("nvfp4", {"weight_scale_search": None}, a.num_samples)
    c = recipe.calibration
    batches = token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"), c.num_samples, c.seq_len,
                            c.seed)
    t0 = time.time()
    calibrate(model, recipe, batches)
    nc._share_weight_amax(model)
    linears = nc._nvfp4_weight_linears(model)
    squares = nc.input_squares(model, linears, forward_loop(batches, "statistics"))
    groups = defaultdict(list)  # linears that read one input share their amax: (parent, amax) identifies them
    for name, m in linears:
        groups[(name.rsplit(".", 1)[0], float(m.weight_quantizer.amax.float().amax()))].append((name, m))
    chosen = defaultdict(int)
    for (_, amax), members in groups.items():
        ws = [m.weight.data for _, m in members]
        sqs = [squares[n] for n, _ in members]
        best = min(a.mults, key=lambda mu: group_loss(ws, amax, sqs, mu))
        chosen[best] += 1
        for name, m in members:
            new_amax = torch.tensor(amax * best)
            w = m.weight.data.clamp(-new_amax, new_amax)
            m.weight.data.copy_(nc.search_clamp(w, new_amax, squares[name]))
            old = m.weight_quantizer.amax
            m.weight_quantizer.amax = new_amax.reshape(old.shape).to(old.dtype)
    seconds = time.time() - t0
    ppl = perplexity(model, seqs)
    print(json.dumps({"mults": a.mults, "chosen": chosen, "calibrate_s": round(seconds),
                      **{s: round(x, 3) for s, x in ppl.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
