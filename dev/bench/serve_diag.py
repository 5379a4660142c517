"""Where the engine's GPU path departs from its reference, and where a decode step's time goes (GPU).

  ops     every op of a 2-layer dummy engine (eager, no graphs) run twice per call, kernel and torch reference
          on the same input: max rel. error per op and shape
  prefill one prefill step of 4 x 2048 tokens: whole model and paged_prefill alone
  replay  per format, the CUDA graph of one decode step replayed alone (GPU time) beside the engine's step time
          at batch 1 (the difference is host work per step)
`python dev/bench/serve_diag.py [--formats fp8,...] [--json PATH]`
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from lowbit import formats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab import load_script  # noqa: E402
from lowbit.kernels import linear, linear_ref, rms_norm, rms_norm_ref, rotary, rotary_ref  # noqa: E402
from lowbit.kernels import silu_and_mul, silu_and_mul_ref  # noqa: E402
from lowbit.serve.layers import attention as attn_mod  # noqa: E402
from lowbit.serve.layers import ops as layers_mod  # noqa: E402
from lowbit.serve.layers.triton_attention import TritonAttentionBackend  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


class Recorder:
    def __init__(self):
        self.max = defaultdict(float)

    def add(self, key, a, b):
        self.max[key] = max(self.max[key], rel(a, b))


def op_errors(bench, args, fmt) -> dict:
    """Each op computes both ways on the same input; the kernel result flows on."""
    rec = Recorder()

    def lin(x, p, bias=None, out_dtype=None):
        y = linear(x, p, bias, out_dtype)
        q = p if p.algo != "NVFP4" else _weight_only(p)
        fp32_fp8 = p.algo == "FP8" and p.input_scale is not None
        ref = bench.fp8_linear_fp32(x, p, bias, out_dtype) if fp32_fp8 else linear_ref(x, q, bias, out_dtype)
        rec.add(f"linear {p.algo} {p.in_features}->{p.out_features} M{'1' if x.numel() == x.shape[-1] else '>1'}",
                y, ref)
        return y

    def norm(x, w, eps, residual=None, quant_scale=None):
        out = rms_norm(x, w, eps, residual, quant_scale)
        rec.add("rms_norm", out[0], rms_norm_ref(x, w, eps, residual, quant_scale)[0])
        return out

    def rot(q, k, positions, cache):
        out = rotary(q, k, positions, cache)
        ref = rotary_ref(q, k, positions, cache)
        rec.add("rotary q", out[0], ref[0])
        rec.add("rotary k", out[1], ref[1])
        return out

    def act(x, quant_scale=None, up_scale=None):
        y = silu_and_mul(x, quant_scale, up_scale)
        rec.add("silu_and_mul", y, silu_and_mul_ref(x, quant_scale, up_scale))
        return y

    class Both(TritonAttentionBackend):
        @staticmethod
        def store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale):
            ref = kv_cache.clone()
            attn_mod.TorchAttentionBackend.store_kv(k, v, ref, slot_mapping, k_scale, v_scale)
            TritonAttentionBackend.store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)
            rec.add("store_kv", kv_cache.float(), ref.float())

        @staticmethod
        def rotary_store_kv(qkv, hq, hk, positions, cache, part_scales, kv_cache, slot_mapping, k_scale, v_scale,
                            qk_norm=None):
            ref = kv_cache.clone()
            q_ref = attn_mod.TorchAttentionBackend.rotary_store_kv(qkv, hq, hk, positions, cache, part_scales, ref,
                                                                   slot_mapping, k_scale, v_scale, qk_norm)
            q = TritonAttentionBackend.rotary_store_kv(qkv, hq, hk, positions, cache, part_scales, kv_cache,
                                                       slot_mapping, k_scale, v_scale, qk_norm)
            rec.add("rotary_store_kv q", q, q_ref)
            rec.add("rotary_store_kv cache", kv_cache.float(), ref.float())
            return q

        @staticmethod
        def attend(q, kv_cache, ctx, scale, k_scale, v_scale, out_scale=None):
            out = TritonAttentionBackend.attend(q, kv_cache, ctx, scale, k_scale, v_scale, out_scale)
            ref = bench.Fp32KvAttention.attend(q, kv_cache, ctx, scale, k_scale, v_scale, out_scale)
            rec.add("attend decode" if ctx.is_decode else "attend prefill", out, ref)
            return out

    engine = bench.build_engine(args, fmt, layers=2, enable_prefix_caching=False, max_batch_size=8,
                                kv_cache_max_tokens=16384, cuda_graphs=False)
    saved = {n: getattr(layers_mod, n) for n in bench.LAYER_OPS}
    layers_mod.quant_linear, layers_mod.rms_norm, layers_mod.rotary, layers_mod.silu_and_mul = lin, norm, rot, act
    attn_mod.set_attention_backend(Both())
    try:
        vocab = engine.runner.model.config["vocab_size"]
        prompts = [bench.random_prompts(1, n, vocab, seed=n)[0] for n in (5, 37, 200, 700)]
        bench.greedy_with_logits(engine, prompts, 4)
    finally:
        for n, f in saved.items():
            setattr(layers_mod, n, f)
        attn_mod.set_attention_backend(TritonAttentionBackend())
    del engine
    bench.free()
    return {k: round(v, 6) for k, v in sorted(rec.max.items())}


_WEIGHT_ONLY = {}


def _weight_only(p):
    from dataclasses import replace
    return _WEIGHT_ONLY.setdefault(id(p), replace(p, fmt=formats.W4A16_NVFP4, input_scale=None))


def replay_times(bench, args, fmt) -> dict:
    import triton

    engine = bench.build_engine(args, fmt)
    g = engine.runner.graphs
    res = {"format": fmt, "weight_gib": round(bench.weight_bytes(engine) / 2**30, 2)}
    for bs in (1, 2, 4, 8, 16, 64, 256):
        ms = triton.testing.do_bench(g.graphs[bs, False].replay, warmup=20, rep=100, return_mode="median")
        res[f"replay_ms_bs{bs}"] = round(ms, 3)
    res["weights_TB_s_bs1"] = round(res["weight_gib"] * 2**30 / res["replay_ms_bs1"] / 1e9, 2)
    vocab = engine.runner.model.config["vocab_size"]
    lat = bench.latency(engine, bench.random_prompts(1, 128, vocab, 2)[0], 64)
    res["engine_itl_ms_bs1"] = lat["itl_ms_median"]
    res["host_ms_per_step_bs1"] = round(lat["itl_ms_median"] - res["replay_ms_bs1"], 3)
    del engine
    bench.free()
    return res


def host_timing(step, reps: int = 3) -> dict:
    """Wall time of a step from an idle device, the part of it the host spends enqueuing (a step whose enqueue
    time is close to its wall time is host-bound or waits on the device inside), and the caching allocator's
    cudaMalloc calls and out-of-memory retries (each retry frees cached blocks: a device-wide sync) during them."""
    before = torch.cuda.memory_stats()
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    after = torch.cuda.memory_stats()
    return {"step_wall_ms": round(1e3 * (t2 - t0), 2), "step_enqueue_ms": round(1e3 * (t1 - t0), 2),
            "cuda_mallocs": after["num_device_alloc"] - before["num_device_alloc"],
            "alloc_retries": after["num_alloc_retries"] - before["num_alloc_retries"]}


def prefill_times(bench, args, fmt, batch=4, length=2048) -> dict:
    """One prefill step of batch x length new tokens: the whole model, and paged_prefill alone (x layers)."""
    import triton

    from lowbit.kernels.attention.paged_prefill import paged_prefill

    engine = bench.build_engine(args, fmt, max_num_tokens=batch * length)
    r, n = engine.runner, batch * length
    dev = r.device
    profile = load_script("kernel_profile.py")
    step, ctx = profile.prefill_step(engine, n, length), profile.prefill_inputs(engine, batch, length)[1]
    res = {"format": fmt, "tokens": n, "model_ms": round(triton.testing.do_bench(step, warmup=2, rep=20,
                                                                                 return_mode="median"), 2)}
    res.update(host_timing(step))
    a = r.attn_layers[0]
    q = torch.randn(n, a.num_heads, a.head_dim, device=dev, dtype=torch.bfloat16)
    one = torch.tensor(1.0, device=dev)
    ms = triton.testing.do_bench(lambda: paged_prefill(q, a.kv_cache, ctx.query_start_loc, ctx.context_lens,
                                                          ctx.block_tables, length, a.scale, one, one),
                                 warmup=5, rep=50, return_mode="median")
    flops = 4 * batch * length * length / 2 * a.num_heads * a.head_dim
    res.update(attn_ms_per_layer=round(ms, 3), attn_ms_all_layers=round(ms * len(r.attn_layers), 2),
               attn_TFLOP_s=round(flops / ms / 1e9, 1),
               model_TFLOP_s=round(2 * n * 6.98e9 / res["model_ms"] / 1e9, 1))  # 6.98e9 params in the 32 layers
    del engine, r, a
    bench.free()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="fp8,bf16,int4_awq,nvfp4")
    p.add_argument("--phases", default="ops,replay")
    p.add_argument("--json")
    p.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU (plumbing check)")
    p.add_argument("--max-splits", type=int, help="decode attention splits the context at most this often (1: the "
                   "check's small batches run the unsplit tiles that large batches use)")
    a = p.parse_args(argv)
    if a.max_splits is not None and a.max_splits < 1:
        p.error(f"--max-splits must be >= 1, got {a.max_splits}")
    if a.max_splits:
        from lowbit.kernels import tuning
        tuning.override(decode_max_splits=a.max_splits).__enter__()  # for the rest of the process
    bench = load_script("serve_bench.py")
    args = bench.parse(["--tiny", "--device", "cpu"] if a.tiny else [])
    out = {}
    for fmt in a.formats.split(","):
        if "ops" in a.phases:
            out[f"ops_{fmt}"] = op_errors(bench, args, fmt)
            print(fmt, json.dumps(out[f"ops_{fmt}"], indent=0), flush=True)
    if "check" in a.phases:
        for fmt in a.formats.split(","):
            out[f"check_{fmt}"] = bench.check_format(args, fmt)
            print(json.dumps(out[f"check_{fmt}"]), flush=True)
    for fmt in a.formats.split(","):
        if "prefill" in a.phases:
            out[f"prefill_{fmt}"] = prefill_times(bench, args, fmt)
            print(json.dumps(out[f"prefill_{fmt}"]), flush=True)
        if "replay" in a.phases:
            out[f"replay_{fmt}"] = replay_times(bench, args, fmt)
            print(json.dumps(out[f"replay_{fmt}"]), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
