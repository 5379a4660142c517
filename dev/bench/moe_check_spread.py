"""The engine check of `lowbit bench serve --phases check` (serve_bench.check_format) split by batch composition: for
the full batch of check prompts and each small batch (SMALL_BATCHES: the M = 1 and M = 2 routes), the kernels' error
against the fp32 reference path and, on the same prompts, the spread between the reference and the checkpoint
reader's bf16 roundings (the bar of static-W8A8 formats is 1.5x that spread, measured on the full batch only).

    python3 dev/bench/moe_check_spread.py [--model qwen3-30b-a3b] [--formats w8a8_sq fp8] [--check-layers 2]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowbit.bench import serve_bench as sb  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--formats", nargs="+", default=["w8a8_sq", "fp8"])
    p.add_argument("--check-layers", default="2")
    a = p.parse_args()
    args = sb.parse(["--check-layers", a.check_layers, "--model", a.model, "--phases", "check"])
    for fmt in a.formats:
        engine = sb.build_engine(args, fmt, layers=args.check_layers, enable_prefix_caching=False, max_batch_size=8,
                                 kv_cache_max_tokens=65536)
        vocab = engine.runner.model.config["vocab_size"]
        lens = [5, 37, 200, 700]
        prompts = [sb.random_prompts(1, n, vocab, seed=n)[0] for n in lens]
        for name, rows in [("full", (0, 1, 2, 3))] + [(f"batch{b}", r) for b, r in sb.SMALL_BATCHES.items()]:
            sub = [prompts[i] for i in rows]
            with sb.reference_path(engine):
                tok_r, logits_r, picks = sb.greedy_with_logits(engine, sub, 12)
            tok_k, logits_k, _ = sb.greedy_with_logits(engine, sub, 12, forced=picks)
            with sb.reference_path(engine, reader_rounding=True):
                tok_q, logits_q, _ = sb.greedy_with_logits(engine, sub, 12, forced=picks)
            sub_lens = [lens[i] for i in rows]
            kern = sb.compare_paths(fmt, args, sub_lens, 12, tok_k, logits_k, tok_r, logits_r)
            spread = sb.compare_paths(fmt, args, sub_lens, 12, tok_q, logits_q, tok_r, logits_r)
            print(f"{fmt} {name:7s} prompts {sub_lens}: kernels vs fp32 reference {kern['logits_rel_err_max']:.4f}, "
                  f"reader roundings vs fp32 reference {spread['logits_rel_err_max']:.4f} "
                  f"(ratio {kern['logits_rel_err_max'] / spread['logits_rel_err_max']:.2f})", flush=True)
        del engine
        sb.free()


if __name__ == "__main__":
    main()
