"""`lowbit bench serve`: lowbit's engine on dummy Llama-3.1-8B weights in each format, against HF transformers.

Phases (each bounded by --deadline-s; a failed phase is reported with its traceback and the rest still run):
  check    kernels + CUDA graphs vs the same engine on the torch reference path, per format, on the same weights
           (a --check-layers-deep model of the real widths): logits rel. error and greedy tokens
  hf       HF transformers `generate` on the same dummy bf16 model, batch --hf-batch, ISL/OSL
  formats  per format: batch-1 latency (TTFT, ITL), offline maximum-load throughput (N requests, EOS ignored),
           and for bf16 the HF workload through lowbit (the ratio)
  extra    FP8 maximum load at other ISL/OSL pairs (--extra)
  interop  batch-1 decode of the same int4 weights in modelopt, compressed-tensors, GPTQ and AutoAWQ layouts, each
           repacked at load (lowbit.bench.serve_interop; not in the default --phases)
The defaults: up to 1024 sequences in flight, 768 requests at 1000/1000 (--max-batch-size 512: half the sequences).
Writes JSON (--json) and a markdown section (--markdown, appended).
"""
import argparse
import gc
import itertools
import json
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F


from lowbit import formats
from lowbit.bench_cli import int_list
from lowbit.kernels import gelu_tanh_and_mul_ref, moe_route_ref, moe_router_ref, silu_and_mul_ref
from lowbit.kernels.linear.act_quant import act_quant_ref
from lowbit.kernels.ops.norm import quantize_fp8_ref
from lowbit.serve.layers import attention as attn_mod
from lowbit.serve.layers import ops as layers_mod
from lowbit.serve.engine.config import EngineConfig
from lowbit.testing.dummy_weights import FORMATS, LLAMA_3_1_8B, PRESETS, dummy_checkpoint
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams

TINY = dict(LLAMA_3_1_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=2048, dtype="float32")


GPU_TOL = 3e-2  # logits rel. error, kernels (bf16 activations) vs the reference path (fp32 math)
TIE_TOL = 0.1  # logit units: a greedy flip counts as a tie when the reference ranks the pick this close to its best


class DummyTokenizer:
    """Token ids in, one character per token out: the engine's incremental detokenization runs at its usual O(1)
    per token, but no real tokenizer's decode cost is measured (none ships to the GPU machine)."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def parse(argv):
    p = argparse.ArgumentParser(prog="lowbit bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="bf16,fp8,int4_awq,nvfp4")
    p.add_argument("--load-format", default="dummy", choices=["dummy"])
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--latency-isl", default="", help="prompt lengths of more batch-1 latency runs, e.g. 8192,32000")
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--max-batch-size", type=int, default=1024)  # maximum load: as many sequences as the H200 holds
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--phases", default="check,attn,hf,formats,sampled,extra")
    p.add_argument("--check-layers", type=int, default=2)
    p.add_argument("--extra", default="1000/1000/768,2048/128/512", help="ISL/OSL/N for FP8 maximum load")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS),
                   help="whose shapes the dummy weights take")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 config (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--deadline-s", type=float, default=1e9)
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    args.latency_isls = int_list(p, "--latency-isl", args.latency_isl)
    if args.model != "llama-3.1-8b" and "hf" in args.phases.split(","):
        p.error(f"the hf phase builds transformers' Llama only; leave it out of --phases for --model {args.model}")
    return args


# ---- engines
def model_config(args, layers=None):
    c = dict(PRESETS[args.model])
    if args.tiny:  # TINY's sizes on the chosen family
        c.update({k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                                       "dtype")})
    if layers:
        c["num_hidden_layers"] = layers
    return c


def build_engine(args, fmt, layers=None, **overrides):
    ckpt = dummy_checkpoint(fmt, model_config(args, layers), device=args.device)
    cfg = dict(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, device=args.device,
               dtype="float32" if args.tiny else "bfloat16")
    cfg.update(overrides)
    with torch.device(args.device):
        return Engine(ckpt.path, EngineConfig(**cfg), ckpt=ckpt, tokenizer=DummyTokenizer())


def free():
    """Returns cached blocks to the driver, so the next engine's KV pool sees them free (drop references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def random_prompts(n, isl, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, isl), generator=g).tolist()


_FRESH_SEEDS = itertools.count(1000)


def fresh_prompts(n, isl, vocab):
    """Prompts no earlier run of this process used: the engine's prefix cache keeps the blocks of finished requests,
    so a run whose prompts repeat an earlier run's (the same seed draws the same first rows) skips their prefill."""
    return random_prompts(n, isl, vocab, next(_FRESH_SEEDS))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- measurements
def offline(engine, prompts, osl, **sampling) -> dict:
    """All requests at once (greedy unless `sampling` sets temperature, top_p, ...); output tokens/s over the run."""
    params = SamplingParams(max_tokens=osl, ignore_eos=True, **({"temperature": 0} | sampling))
    base = f"r{time.monotonic_ns()}-"
    sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(base + str(i), p, params)
    out_tokens, steps = 0, 0
    while engine.has_unfinished():
        out_tokens += sum(len(o.delta_token_ids) for o in engine.step())
        steps += 1
    sync()
    dt = time.perf_counter() - t0
    return {"requests": len(prompts), "isl": len(prompts[0]), "osl": osl, "output_tokens": out_tokens,
            "seconds": round(dt, 3), "steps": steps, "output_tok_s": round(out_tokens / dt, 1),
            "total_tok_s": round((out_tokens + len(prompts) * len(prompts[0])) / dt, 1)}


def warm_up(engine, args, isl, osl, n) -> None:
    """A shorter run of the same shapes first: Triton compiles a kernel variant the first time it meets a new
    specialization (e.g. a token count that is or is not a multiple of 16), which takes seconds out of the first
    maximum-load run of a process."""
    vocab = engine.runner.model.config["vocab_size"]
    offline(engine, fresh_prompts(min(n, 2 * args.max_batch_size), isl, vocab), min(osl, 32))


def latency(engine, prompt, osl) -> dict:
    """One request alone: time to first token and inter-token latency."""
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    engine.add_request(f"lat{time.monotonic_ns()}", prompt, params)
    stamps = []
    while engine.has_unfinished():
        if any(o.delta_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    itl = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return {"isl": len(prompt), "osl": osl, "ttft_ms": round(1e3 * (stamps[0] - t0), 2),
            "itl_ms_median": round(1e3 * itl[len(itl) // 2], 3), "itl_ms_mean": round(1e3 * sum(itl) / len(itl), 3),
            "decode_tok_s": round(len(itl) / sum(itl), 1)}


def weight_bytes(engine) -> int:
    """Bytes of every tensor the model holds for its weights (prepared layouts included), counted once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for m in engine.runner.model.modules():
        for t in list(m.parameters(recurse=False)) + [getattr(m, "weight", None), getattr(m, "bias", None)]:
            add(t)
        for t in [getattr(m, "w13", None), getattr(m, "w2", None)]:  # MoE experts: stacked, not parameters
            add(t)
        for scales in [getattr(m, kind, None) for kind in ("fp8", "int4", "nvfp4", "int8")]:
            for t in scales if isinstance(scales, tuple) else ():
                add(t)
        p = getattr(m, "prepared", None)
        if p is not None:
            w = p.weight
            for t in [w, p.weight_scale, p.input_scale, p.smooth] + list((p.source or {}).values()) + \
                    list(getattr(w, "__dict__", {}).values()):
                add(t)
    return total


# ---- correctness: kernels (+ graphs) vs the torch reference path on the same engine and weights
class Fp32KvAttention(attn_mod.TorchAttentionBackend):
    """The torch attention with FP8 K/V dequantized to fp32 (as the kernel scales scores and outputs in fp32), not
    rounded to bf16 first as the checkpoint reader's fake-quantized KV cache is."""

    @staticmethod
    def attend(q, kv_cache, ctx, scale, k_scale, v_scale, out_scale=None, sliding_window=None, logit_softcap=None):
        win = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
        if kv_cache.dtype != torch.float8_e4m3fn:
            return attn_mod.TorchAttentionBackend.attend(q, kv_cache, ctx, scale, k_scale, v_scale, out_scale, **win)
        out = attn_mod.TorchAttentionBackend.attend(q.float(), kv_cache, ctx, scale, k_scale, v_scale,
                                                    **win).to(q.dtype)
        return out if out_scale is None else quantize_fp8_ref(out, out_scale)


def fp8_linear_fp32(x, p, bias, out_dtype):
    """Static FP8 as the kernels compute it: FP8 codes of x times the scales, fp32 math, one rounding at the end
    (linear_ref rounds the dequantized activation to bf16 first, as modelopt's fake quantization does)."""
    codes = x if x.dtype == torch.float8_e4m3fn else quantize_fp8_ref(x, p.input_scale)
    y = (codes.float() * p.input_scale) @ p.ref_weight().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or (torch.bfloat16 if x.dtype == torch.float8_e4m3fn else x.dtype))


def int8_linear_fp32(x, p, bias, out_dtype):
    """Static INT8 (SmoothQuant) as the kernels compute it: int8 codes of the smoothed x, fp32 math on them times the
    scales, one rounding at the end (linear_ref rounds the dequantized activation to x's dtype first)."""
    codes, scale = act_quant_ref(x, torch.int8, p.input_scale, p.smooth)
    y = (codes.float() * scale) @ p.ref_weight().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# static W8A8 formats -> their linears as the kernels compute them (formats of these take the check's spread rule)
STATIC_W8A8_FORMATS = {formats.FP8: fp8_linear_fp32, formats.W8A8_SQ_PER_CHANNEL: int8_linear_fp32}


# the kernel ops layers call
LAYER_OPS = ("dense_linear", "quant_linear", "rms_norm", "rotary", "silu_and_mul", "gelu_tanh_and_mul", "fused_moe",
             "moe_route", "moe_router")


def fused_moe_fp32(x, w13, w2, topk_ids, topk_weights, fp8=None, int4=None, nvfp4=None, int8=None):
    """The MoE reference in fp32 math (16-bit experts upcast; FP8, INT8, INT4 and NVFP4 experts already are), rounded
    to x's dtype."""
    from lowbit.kernels import fused_moe_ref

    if fp8 is None and int4 is None and nvfp4 is None and int8 is None:
        w13, w2 = w13.float(), w2.float()
    return fused_moe_ref(x.float(), w13, w2, topk_ids, topk_weights, fp8=fp8, int4=int4, nvfp4=nvfp4,
                         int8=int8).to(x.dtype)


def dense_linear_fp32(x, weight, bias=None, silu_mul=False):
    """An unquantized linear in fp32 math, rounded to x's dtype (then silu_and_mul's reference, silu_mul)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return silu_and_mul_ref(y) if silu_mul else y


@contextmanager
def reference_path(engine, reader_rounding: bool = False):
    """Every op on its torch reference in fp32 math (NVFP4 as the weight-only reference, which is what Hopper serves;
    static FP8 / INT8 linears and FP8 KV attention as fp32 math on the codes, which is what the kernels compute).
    reader_rounding: static W8A8 as the checkpoint reader computes it instead (dequantized activations and K/V rounded
    to bf16 first, as modelopt's fake quantization does)."""
    from lowbit.kernels import linear_ref, rms_norm_ref, rotary_ref

    weight_only = {}

    def ref_linear(x, p, bias=None, out_dtype=None):
        if p.fmt in STATIC_W8A8_FORMATS and p.input_scale is not None and not reader_rounding:
            return STATIC_W8A8_FORMATS[p.fmt](x, p, bias, out_dtype)
        if p.fmt is formats.NVFP4:
            from dataclasses import replace
            p = weight_only.setdefault(id(p), replace(p, fmt=formats.W4A16_NVFP4, input_scale=None))
        return linear_ref(x, p, bias, out_dtype)

    saved = {n: getattr(layers_mod, n) for n in LAYER_OPS}
    backend, graphs = attn_mod._backend, engine.runner.graphs
    layers_mod.dense_linear, layers_mod.quant_linear, layers_mod.rms_norm = dense_linear_fp32, ref_linear, rms_norm_ref
    layers_mod.rotary, layers_mod.silu_and_mul = rotary_ref, silu_and_mul_ref  # rotary_store_kv: the backend's
    layers_mod.gelu_tanh_and_mul, layers_mod.fused_moe = gelu_tanh_and_mul_ref, fused_moe_fp32
    layers_mod.moe_route, layers_mod.moe_router = moe_route_ref, moe_router_ref
    attn_mod.set_attention_backend(attn_mod.TorchAttentionBackend() if reader_rounding else Fp32KvAttention())
    engine.runner.graphs = None
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(layers_mod, n, f)
        attn_mod.set_attention_backend(backend)
        engine.runner.graphs = graphs


def greedy_with_logits(engine, prompts, osl, forced: list[list[int]] | None = None):
    """-> (tokens per prompt, logits [rows, V] per step, the tokens sampled per step); the schedule is the same
    whatever tokens come out. forced: another run's tokens per step, fed instead of this run's own choices."""
    steps, picks = [], []
    run, sampler, overlap = engine.runner.run, engine.sampler, engine.overlap

    def recording(batch, rows, pending=None):
        out = run(batch, rows, pending)
        steps.append(out.float().clone())
        return out

    def recording_sampler(logits, params, seeds, positions, bitmask=None):
        if forced:  # teacher forcing: the other run's tokens of this step (same schedule, same rows)
            tokens, logprobs = list(forced[len(picks)]), [None] * len(params)
        else:
            tokens, logprobs = sampler(logits, params, seeds, positions, bitmask)
        picks.append(tokens)
        return tokens, logprobs

    engine.runner.run, engine.sampler = recording, recording_sampler
    engine.overlap = False  # each step's logits and tokens are read as the step ends
    try:
        tokens = greedy(engine, prompts, osl)
    finally:
        engine.runner.run, engine.sampler, engine.overlap = run, sampler, overlap
    return tokens, steps, picks


def greedy(engine, prompts, osl) -> list[list[int]]:
    """The greedy completion tokens of each prompt, all requests at once."""
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    ids = [f"greedy{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, params)
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.delta_token_ids
    return [tokens[i] for i in ids]


def greedy_overlapped(engine, prompts, osl) -> list[list[int]]:
    """The same requests with the host one step behind the device (the engine's default on a GPU)."""
    overlap, engine.overlap = engine.overlap, True
    try:
        return greedy(engine, prompts, osl)
    finally:
        engine.overlap = overlap


SMALL_BATCHES = {1: (2,), 2: (1, 2)}  # batch size -> which check prompts run alone at that batch


def reader_spread(engine, fmt, args, prompts, lens, osl, picks_r, tok_r, logits_r) -> dict:
    """compare_paths of the reader's bf16 roundings against the fp32 reference run (tok_r, logits_r, its greedy
    picks_r) on the same prompts, teacher-forced with those picks."""
    with reference_path(engine, reader_rounding=True):
        tok_q, logits_q, _ = greedy_with_logits(engine, prompts, osl, forced=picks_r)
    return compare_paths(fmt, args, lens, osl, tok_q, logits_q, tok_r, logits_r)


def check_format(args, fmt) -> dict:
    """Kernels + graphs vs the fp32 reference path on the same engine and weights, every step teacher-forced with
    the reference's greedy tokens (so the inputs stay equal and all steps compare); a free-running kernel run
    reports whether the greedy tokens also come out the same on their own."""
    engine = build_engine(args, fmt, layers=args.check_layers, enable_prefix_caching=False, max_batch_size=8,
                          kv_cache_max_tokens=65536)
    vocab = engine.runner.model.config["vocab_size"]
    lens = [5, 37, 200, 700] if not args.tiny else [3, 20, 45]
    prompts = [random_prompts(1, n, vocab, seed=n)[0] for n in lens]
    osl = 12
    with reference_path(engine):
        tok_r, logits_r, picks_r = greedy_with_logits(engine, prompts, osl)
    tok_k, logits_k, _ = greedy_with_logits(engine, prompts, osl, forced=picks_r)
    res = compare_paths(fmt, args, lens, osl, tok_k, logits_k, tok_r, logits_r)
    static = formats.get(FORMATS[fmt][0]) in STATIC_W8A8_FORMATS
    spreads = [reader_spread(engine, fmt, args, prompts, lens, osl, picks_r, tok_r, logits_r)] if static else []
    runs = {"": (prompts, res)}  # key prefix of the result -> (prompts, compare_paths of that run)
    for b, rows in SMALL_BATCHES.items():  # the GEMMs' M = 1 and M = 2 routes (the batch-1 GEMVs launch early)
        sub, sub_lens = [prompts[i] for i in rows], [lens[i] for i in rows]
        with reference_path(engine):
            tok_rb, logits_rb, picks_rb = greedy_with_logits(engine, sub, osl)
        tok_kb, logits_kb, _ = greedy_with_logits(engine, sub, osl, forced=picks_rb)
        runs[f"batch{b}_"] = (sub, compare_paths(fmt, args, sub_lens, osl, tok_kb, logits_kb, tok_rb, logits_rb))
        if static:
            spreads.append(reader_spread(engine, fmt, args, sub, sub_lens, osl, picks_rb, tok_rb, logits_rb))
            res[f"batch{b}_reader_vs_fp32_reference_rel_err_max"] = spreads[-1]["logits_rel_err_max"]
    free_running, _, _ = greedy_with_logits(engine, prompts, osl)
    res["free_running_same_tokens"] = f"{sum(a == b for a, b in zip(free_running, tok_r))}/{len(prompts)}"
    res["overlapped_steps_same_tokens"] = greedy_overlapped(engine, prompts, osl) == free_running
    res["graph_used"] = engine.runner.graphs is not None
    tol, tie = GPU_TOL, TIE_TOL
    if static:
        # Static FP8 / INT8 activation quantization turns ulp-level differences into flipped codes that compound over
        # layers, so the bar is the spread between two rounding conventions of the same reference: the kernels may
        # differ from the fp32 reference by at most 1.5x what the checkpoint reader's bf16 roundings do, in logits
        # and in how far below the reference's best their greedy pick lies. That spread depends on which prompts
        # run together (the reference's own GEMM shapes change with the batch): the largest over the batches run.
        res["reader_vs_fp32_reference_rel_err_max"] = max(x["logits_rel_err_max"] for x in spreads)
        res["reader_vs_fp32_reference_argmax_gap_max"] = max(x["argmax_gap_max"] for x in spreads)
        tol = max(GPU_TOL, 1.5 * res["reader_vs_fp32_reference_rel_err_max"])
        tie = max(TIE_TOL, 1.5 * res["reader_vs_fp32_reference_argmax_gap_max"])  # the same rule for the greedy pick
    res["tolerance"], res["tie_tolerance"] = tol, tie
    for key, (run_prompts, cmp) in runs.items():
        cmp = without_router_ties(engine, run_prompts, osl, cmp, tol, tie)
        res[f"{key}logits_rel_err_max"], res[f"{key}argmax_gap_max"] = cmp["logits_rel_err_max"], cmp["argmax_gap_max"]
        if "router_tie_steps" in cmp:
            res[f"{key}router_tie_steps"] = cmp["router_tie_steps"]
    # every step within tolerance, and the kernels' own greedy pick never more than a near tie below the
    # reference's best (random weights give a 128k-way near tie often)
    res["pass"] = all(res[f"{key}logits_rel_err_max"] < tol and res[f"{key}argmax_gap_max"] <= tie for key in runs) \
        and res["overlapped_steps_same_tokens"]
    del engine
    free()
    return res


def compare_paths(fmt, args, lens, osl, tok_k, logits_k, tok_r, logits_r) -> dict:
    """Logits of two runs step by step, up to the first step where a greedy token differs (inputs still equal)."""
    first_diff = next((s for s in range(osl) if any(a[s] != b[s] for a, b in zip(tok_k, tok_r))), osl)
    compared = logits_k[:first_diff + 1]  # steps whose inputs are still the same on both paths
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(compared, logits_r)]
    absd = [(a - b).abs().max().item() for a, b in zip(compared, logits_r)]
    top1 = [(a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(compared, logits_r)]
    # how far below the reference's best logit the kernel path's greedy choice lies (0 when they agree)
    gap = [(b.max(-1).values - b.gather(1, a.argmax(-1, keepdim=True))[:, 0]).max().item()
           for a, b in zip(compared, logits_r)]
    same = sum(a == b for a, b in zip(tok_k, tok_r))
    res = {"format": fmt, "layers": args.check_layers, "prompt_lens": lens, "osl": osl,
           "logits_rel_err_max": max(rel), "logits_abs_err_max": max(absd), "logits_std": logits_r[0].std().item(),
           "top1_agreement_min": min(top1), "argmax_gap_max": max(gap), "sequences_same_tokens": f"{same}/{len(tok_r)}",
           "rel_err_per_step": [round(r, 5) for r in rel], "argmax_gap_per_step": gap,
           "first_divergent_step": first_diff if first_diff < osl else None, "same": same == len(tok_r)}
    return res


def without_router_ties(engine, prompts, osl, cmp: dict, tol: float, tie: float) -> dict:
    """cmp (compare_paths) with its steps over a bar left out of the maxima where a router tie decided them
    (lowbit.bench.route_ties), those steps listed under router_tie_steps; at most a quarter of the steps compared
    may be left out, else cmp as it is (that many ties would hide a fault)."""
    from lowbit.bench.route_ties import router_tie_steps

    from lowbit.serve.layers.moe import SparseMoe

    rel, gap = cmp["rel_err_per_step"], cmp["argmax_gap_per_step"]
    over = [s for s in range(len(rel)) if rel[s] >= tol or gap[s] > tie]
    if not over or not any(isinstance(m, SparseMoe) for m in engine.runner.model.modules()):
        return cmp  # nothing to explain, or no router to explain it
    ties = router_tie_steps(engine, prompts, osl)
    excused = [s for s in over if s in ties]
    kept = [s for s in range(len(rel)) if s not in excused]
    if not excused or 4 * len(excused) > len(rel):
        return cmp
    return {**cmp, "logits_rel_err_max": max(rel[s] for s in kept), "argmax_gap_max": max(gap[s] for s in kept),
            "router_tie_steps": {s: ties[s] for s in excused}}


# ---- decode attention alone
def attention_decode_speed(args) -> list[dict]:
    """paged_decode at Llama-8B heads: time and GB/s of the KV bytes it must read (K and V of every token)."""
    import triton

    from lowbit.kernels.attention import paged_attention as pa

    rows = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch, ctx in ((1, 4096), (1, 32768), (64, 1024), (64, 4096), (256, 1024)):
            bs, hk, d = 16, 8, 128
            nblk = batch * ctx // bs
            cache = torch.randn(2, nblk, bs, hk, d, device="cuda").to(kv_dtype)
            tables = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, -1)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, 32, d, device="cuda", dtype=torch.bfloat16)
            one = torch.tensor(1.0, device="cuda")
            splits = pa.decode_splits(batch, hk, ctx)  # as the engine picks them
            ms = triton.testing.do_bench(lambda: pa.paged_decode(q, cache, tables, lens, d ** -0.5, one, one,
                                                                 num_splits=splits),
                                         warmup=25, rep=100, return_mode="median")
            nbytes = cache.numel() * cache.element_size()
            rows.append({"kv": str(kv_dtype).split(".")[-1], "batch": batch, "ctx": ctx, "us": round(ms * 1e3, 1),
                         "GB_s": round(nbytes / ms / 1e6), "splits": splits})
            del cache
    return rows


# ---- HF transformers on the same weights
def hf_generate(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model_config(args)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(LlamaConfig(**c)).eval()
    finally:
        torch.set_default_dtype(prev)
    lazy = dummy_checkpoint("bf16", c, device=args.device).tensors()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(lazy[name])
    vocab = c["vocab_size"]
    ids = torch.tensor(random_prompts(args.hf_batch, args.isl, vocab, seed=7), device=args.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.osl, min_new_tokens=args.osl, **kw)
        sync()
    dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model, lazy
    free()
    return {"batch": args.hf_batch, "isl": args.isl, "osl": args.osl, "seconds": round(dt, 3),
            "output_tok_s": round(n / dt, 1), "transformers": __import__("transformers").__version__}


# ---- per format
def bench_format(args, fmt, results) -> dict:
    t0 = time.perf_counter()
    engine = build_engine(args, fmt)
    res = {"format": fmt, "build_s": round(time.perf_counter() - t0, 1), "kv_blocks": engine.runner.num_blocks,
           "kv_tokens": engine.runner.num_blocks * engine.config.block_size,
           "weight_gib": round(weight_bytes(engine) / 2**30, 2),
           "graph_sizes": engine.runner.graphs.sizes if engine.runner.graphs is not None else None}
    if len(engine.runner.kv_blocks) > 1:  # a KV pool per layer kind: kv_blocks is the full-attention layers' pool
        res["kv_window_blocks"] = engine.runner.kv_blocks[1]
    vocab = engine.runner.model.config["vocab_size"]
    offline(engine, fresh_prompts(min(32, args.num_requests), args.isl, vocab), 4)  # warm-up: prefill shapes
    latency(engine, random_prompts(1, args.isl, vocab, 1)[0], 4)  # and one prompt alone (the W4 prefill kernels
    # compile per M range: else the timed TTFT below includes a compile of ~2 s)
    res["batch1"] = latency(engine, random_prompts(1, args.isl, vocab, 2)[0], args.osl)
    res["batch1_long"] = [latency(engine, random_prompts(1, isl, vocab, 3)[0], args.osl) for isl in args.latency_isls]
    warm_up(engine, args, args.isl, args.osl, args.num_requests)
    res["max_load"] = offline(engine, fresh_prompts(args.num_requests, args.isl, vocab), args.osl)
    if "output_tok_s" in results.get("hf", {}):  # every format against HF's bf16 run of the same float weights
        res["hf_workload"] = offline(engine, random_prompts(args.hf_batch, args.isl, vocab, 7), args.osl)
        res["hf_workload"]["ratio_vs_hf"] = round(res["hf_workload"]["output_tok_s"]
                                                  / results["hf"]["output_tok_s"], 1)
        res["max_load"]["ratio_vs_hf"] = round(res["max_load"]["output_tok_s"] / results["hf"]["output_tok_s"], 1)
    if fmt == "fp8" and "sampled" in args.phases:  # OpenAI's default temperature 1, with nucleus truncation
        res["max_load_sampled"] = offline(engine, fresh_prompts(args.num_requests, args.isl, vocab), args.osl,
                                          temperature=1.0, top_p=0.9)
    if fmt == "fp8" and "extra" in args.phases:
        res["extra"] = []
        for spec in filter(None, args.extra.split(",")):
            if time.monotonic() > args.deadline:
                res["extra"].append({"spec": spec, "skipped": "deadline"})
                continue
            isl, osl, n = map(int, spec.split("/"))
            warm_up(engine, args, isl, osl, n)
            res["extra"].append(offline(engine, fresh_prompts(n, isl, vocab), osl))
    del engine
    free()
    return res


def phase(results, name, fn, args):
    if time.monotonic() > args.deadline:
        results[name] = {"skipped": "deadline"}
        print(f"[{name}] skipped: deadline", flush=True)
        return
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # reported in the JSON and printed; the other phases still run
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        traceback.print_exc()
        free()
    print(f"[{name}] {time.perf_counter() - t0:.1f}s {json.dumps(results[name])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def markdown(r: dict) -> str:
    lines = [f"\n### Serving run {r['date']} ({r['gpu']}, torch {r['torch']}, {r['model']})\n",
             f"`{r['command']}`\n"]
    checks = [v for k, v in r.items() if k.startswith("check_") and "format" in v]
    if checks:
        lines += ["| format | logits rel err (max) | abs err (max) | top-1 agree (min) | argmax gap (max) "
                  "| same greedy tokens | pass |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['format']} | {c['logits_rel_err_max']:.2e} | {c['logits_abs_err_max']:.3f} | "
                  f"{c['top1_agreement_min']:.3f} | {c.get('argmax_gap_max', float('nan')):.3f} | "
                  f"{c['sequences_same_tokens']} | {c['pass']} |" for c in checks]
        lines.append("")
    serves = [v for k, v in r.items() if k.startswith("serve_") and "format" in v]
    if serves:
        lines += ["| format | weights GiB | batch-1 decode tok/s | TTFT ms | ITL ms (median) | max-load out tok/s "
                  "| requests x ISL/OSL | KV tokens |", "|---|---|---|---|---|---|---|---|"]
        for s in serves:
            b, m = s["batch1"], s["max_load"]
            lines.append(f"| {s['format']} | {s['weight_gib']} | {b['decode_tok_s']} | {b['ttft_ms']} | "
                         f"{b['itl_ms_median']} | {m['output_tok_s']} | {m['requests']} x {m['isl']}/{m['osl']} | "
                         f"{s['kv_tokens']} |")
            for lb in s.get("batch1_long", []):
                lines.append(f"| {s['format']}, batch 1, ISL {lb['isl']} | | {lb['decode_tok_s']} | {lb['ttft_ms']} | "
                             f"{lb['itl_ms_median']} | | | |")
            for e in s.get("extra", []):
                if "output_tok_s" in e:
                    lines.append(f"| {s['format']} | | | | | {e['output_tok_s']} | {e['requests']} x "
                                 f"{e['isl']}/{e['osl']} | |")
        lines.append("")
    attn = r.get("attention_decode")
    if isinstance(attn, list):
        lines += ["| paged decode attention | batch | context | us | KV GB/s | splits |", "|---|---|---|---|---|---|"]
        lines += [f"| {a['kv']} KV | {a['batch']} | {a['ctx']} | {a['us']} | {a['GB_s']} | {a['splits']} |"
                  for a in attn]
        lines.append("")
    hf = r.get("hf", {})
    same = [(v["format"], v["hf_workload"]) for k, v in r.items()
            if k.startswith("serve_") and isinstance(v, dict) and "hf_workload" in v]
    if "output_tok_s" in hf and same:
        lowbit = "; ".join(f"{fmt} {w['output_tok_s']} tok/s (**{w['ratio_vs_hf']}x**)" for fmt, w in same)
        lines.append(f"HF transformers {hf['transformers']} `generate`, same dummy bf16 model, batch {hf['batch']}, "
                     f"{hf['isl']}/{hf['osl']}: {hf['output_tok_s']} tok/s. lowbit on the same workload (each format "
                     f"quantized from the same seeded float weights): {lowbit}.\n")
    if "rows" in r.get("interop", {}):
        from lowbit.bench import serve_interop

        lines += serve_interop.markdown(r["interop"])
    failed = [k for k, v in r.items() if isinstance(v, dict) and ("error" in v or "skipped" in v)]
    if failed:
        lines.append(f"Not measured: {', '.join(failed)} (see the JSON).\n")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    args.deadline = time.monotonic() + args.deadline_s
    chosen = [f for f in args.formats.split(",") if f]
    unknown = set(chosen) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown formats {sorted(unknown)}; known: {sorted(FORMATS)}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu,
               "torch": torch.__version__, "command": "lowbit bench serve " + " ".join(argv or sys.argv[1:]),
               "model": f"{args.model} shapes, dummy weights" if not args.tiny else "tiny"}
    if "check" in args.phases:
        for fmt in chosen:
            phase(results, f"check_{fmt}", lambda: check_format(args, fmt), args)
    if "attn" in args.phases:
        phase(results, "attention_decode", lambda: attention_decode_speed(args), args)
    if "hf" in args.phases:
        phase(results, "hf", lambda: hf_generate(args), args)
    if "formats" in args.phases:
        for fmt in chosen:
            phase(results, f"serve_{fmt}", lambda: bench_format(args, fmt, results), args)
    if "interop" in args.phases:
        from lowbit.bench.serve_interop import interop

        phase(results, "interop", lambda: interop(args), args)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
