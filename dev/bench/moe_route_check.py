"""Does the router's top-k kernel change a Qwen3-MoE engine check? For each format: lowbit bench serve's check (2
layers of Qwen3-30B-A3B's shapes, dummy weights) with the kernel path routing by the kernel, then by torch's chain;
and, on every router call of the kernel run, how often the kernel's experts differ from torch.topk's on the same
logits, split into exact ties (equal probabilities) and real differences.

    python3 dev/bench/moe_route_check.py [--formats nvfp4 fp8]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench import serve_bench as bench  # noqa: E402
from lowbit.kernels.moe import route as route_mod  # noqa: E402
from lowbit.serve.layers import ops  # noqa: E402

KEYS = ("logits_rel_err_max", "batch1_logits_rel_err_max", "batch2_logits_rel_err_max", "argmax_gap_max",
        "tolerance", "sequences_same_tokens", "free_running_same_tokens", "pass")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "fp8"])
    a = ap.parse_args()
    args = bench.parse(["--check-layers", "2", "--model", "qwen3-30b-a3b", "--phases", "check"])
    kernel = ops.moe_route
    for fmt in a.formats:
        counts = {"calls": 0, "rows": 0, "tie_rows": 0, "real_rows": 0}

        def counting(logits, top_k, renormalize):
            w, ids = kernel(logits, top_k, renormalize)
            if logits.is_cuda and not torch.cuda.is_current_stream_capturing():
                probs = torch.softmax(logits.float(), -1)
                _, ref_ids = torch.topk(probs, top_k, -1)
                differ = (ids.sort(-1).values != ref_ids.sort(-1).values).any(-1)
                real = (probs.gather(1, ids).sort(-1).values != probs.gather(1, ref_ids).sort(-1).values).any(-1)
                counts["calls"] += 1
                counts["rows"] += logits.shape[0]
                counts["real_rows"] += int(real.sum())
                counts["tie_rows"] += int((differ & ~real).sum())
            return w, ids

        for label, fn in (("kernel", counting), ("torch", route_mod.moe_route_ref)):
            ops.moe_route = fn
            try:
                res = bench.check_format(args, fmt)
            finally:
                ops.moe_route = kernel
            print(json.dumps({"format": fmt, "route": label, **{k: res.get(k) for k in KEYS}}), flush=True)
        print(json.dumps({"format": fmt, "router_calls_outside_graphs": counts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
