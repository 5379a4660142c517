"""Where do the kernel path and the fp32 reference path of a MoE engine check route tokens differently? The check's
batch-1 and batch-2 runs (lowbit bench serve's check_format prompts, 2 layers of Qwen3-30B-A3B's shapes, dummy
weights), both paths eager (graphs off: the router calls are seen), the kernel path teacher-forced with the
reference's tokens; per step, per MoE layer, the rows whose chosen experts differ, with the reference's gap between
its k-th and (k+1)-th router logits there, and the step's logits error.

    python3 dev/bench/moe_route_diff.py [--format nvfp4] [--tiny]     # --tiny: CPU, tiny shapes
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench import serve_bench as bench  # noqa: E402
from lowbit.bench.route_ties import recording_routes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    extra = ["--tiny", "--device", "cpu"] if a.tiny else []
    args = bench.parse(["--check-layers", "2", "--model", "qwen3-30b-a3b", "--phases", "check", *extra])
    engine = bench.build_engine(args, a.format, layers=2, enable_prefix_caching=False, max_batch_size=8,
                                kv_cache_max_tokens=65536)
    engine.runner.graphs = None
    vocab = engine.runner.model.config["vocab_size"]
    lens = [3, 20, 45] if a.tiny else [5, 37, 200, 700]
    prompts = [bench.random_prompts(1, n, vocab, seed=n)[0] for n in lens]
    for b, rows in bench.SMALL_BATCHES.items():
        sub = [prompts[i] for i in rows]

        ref_steps, ker_steps = [], []
        with bench.reference_path(engine), recording_routes(engine, ref_steps):
            tok_r, logits_r, picks_r = bench.greedy_with_logits(engine, sub, 12)
        with recording_routes(engine, ker_steps):
            _, logits_k, _ = bench.greedy_with_logits(engine, sub, 12, forced=picks_r)
        for s, (rs, ks) in enumerate(zip(ref_steps, ker_steps)):
            err = ((logits_k[s] - logits_r[s]).norm() / logits_r[s].norm()).item()
            diffs = []
            for layer, ((rl, rid), (_, kid)) in enumerate(zip(rs, ks)):
                top = torch.topk(rl, rid.shape[1] + 1, -1).values
                gap = top[:, -2] - top[:, -1]
                bad = (rid.sort(-1).values != kid.sort(-1).values).any(-1).nonzero().flatten().tolist()
                diffs += [{"layer": layer, "row": r, "ref_gap": round(gap[r].item(), 5)} for r in bad]
                min_gap = round(gap.min().item(), 5)
            print(json.dumps({"batch": b, "step": s, "logits_rel_err": round(err, 5), "routing_differs": diffs,
                              "min_ref_gap_last_layer": min_gap}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
