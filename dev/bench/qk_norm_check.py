"""Does fusing Qwen3's per-head q/k RMSNorm into the rotary + KV-store kernel change a Qwen3-MoE engine check? For
each format: lowbit bench serve's check (2 layers of Qwen3-30B-A3B's shapes, dummy weights) with the fused path,
then with the unfused one it replaced (q_norm, k_norm, rotary, then Attention.forward's K/V store).

    python3 dev/bench/qk_norm_check.py [--formats nvfp4]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench import serve_bench as bench  # noqa: E402
from lowbit.serve.layers.blocks import SelfAttention  # noqa: E402

KEYS = ("logits_rel_err_max", "batch1_logits_rel_err_max", "batch2_logits_rel_err_max", "argmax_gap_max",
        "tolerance", "free_running_same_tokens", "pass")


def unfused_forward(self, hidden, ctx):
    qkv = self.qkv_proj(hidden)
    if self.q_norm is None:
        return self.o_proj(self.attn.forward_qkv(qkv, self.rotary[0].cos_sin_cache, self.qkv_proj.part_scales, ctx,
                                                 self.o_proj.fp8_input_scale))
    q, k, v = qkv.split(self.sizes, dim=-1)
    t = hidden.shape[0]
    q = self.q_norm(q.view(t, -1, self.head_dim)).view(t, -1)
    k = self.k_norm(k.view(t, -1, self.head_dim)).view(t, -1)
    q, k = self.rotary[0](ctx.positions, q, k)
    return self.o_proj(self.attn(q, k, v, ctx, self.o_proj.fp8_input_scale))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["nvfp4"])
    ap.add_argument("--all-early-max", type=int, help="override cuda_graphs.ALL_EARLY_MAX_BATCH (PDL launches)")
    ap.add_argument("--fused-only", action="store_true")
    a = ap.parse_args()
    if a.all_early_max is not None:
        from lowbit.serve.runner import cuda_graphs
        cuda_graphs.ALL_EARLY_MAX_BATCH = a.all_early_max
    seen = set()

    def show(self, hidden, ctx):  # the qkv rows the fused kernel reads, once per (rows, dtype)
        qkv = self.qkv_proj(hidden)
        key = (qkv.shape[0] <= 2, qkv.dtype, qkv.stride())
        if key not in seen and qkv.shape[0] <= 2:
            seen.add(key)
            print(f"qkv {tuple(qkv.shape)} {qkv.dtype} stride {qkv.stride()} contiguous {qkv.is_contiguous()}",
                  flush=True)
        return fused(self, hidden, ctx)
    args = bench.parse(["--check-layers", "2", "--model", "qwen3-30b-a3b", "--phases", "check"])
    fused = SelfAttention.forward
    for fmt in a.formats:
        variants = (("fused", show),) if a.fused_only else (("fused", show), ("unfused", unfused_forward))
        for label, forward in variants:
            SelfAttention.forward = forward
            try:
                res = bench.check_format(args, fmt)
            finally:
                SelfAttention.forward = fused
            print(json.dumps({"format": fmt, "qk_norm": label, **{k: res.get(k) for k in KEYS}}), flush=True)
    return 0


def per_step(fmt: str = "nvfp4") -> None:
    """The batch-1 and batch-2 sub-checks of check_format, fused and unfused: the kernel path's logits error per step
    (step 0: the prefill's last token)."""
    args = bench.parse(["--check-layers", "2", "--model", "qwen3-30b-a3b", "--phases", "check"])
    fused = SelfAttention.forward
    for label, forward in (("fused", fused), ("unfused", unfused_forward)):
        SelfAttention.forward = forward
        try:
            engine = bench.build_engine(args, fmt, layers=2, enable_prefix_caching=False, max_batch_size=8,
                                        kv_cache_max_tokens=65536)
            vocab = engine.runner.model.config["vocab_size"]
            lens = [5, 37, 200, 700]
            prompts = [bench.random_prompts(1, n, vocab, seed=n)[0] for n in lens]
            for b, rows in bench.SMALL_BATCHES.items():
                sub, sub_lens = [prompts[i] for i in rows], [lens[i] for i in rows]
                with bench.reference_path(engine):
                    tok_r, logits_r, picks_r = bench.greedy_with_logits(engine, sub, 12)
                tok_k, logits_k, _ = bench.greedy_with_logits(engine, sub, 12, forced=picks_r)
                small = bench.compare_paths(fmt, args, sub_lens, 12, tok_k, logits_k, tok_r, logits_r)
                print(json.dumps({"qk_norm": label, "batch": b, "rows": rows,
                                  "rel_err_per_step": small["rel_err_per_step"]}), flush=True)
            del engine
            bench.free()
        finally:
            SelfAttention.forward = fused


if __name__ == "__main__":
    if sys.argv[1:] == ["--per-step"]:
        per_step()
        sys.exit(0)
    sys.exit(main())
