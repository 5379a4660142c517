"""Where a step's device time goes, kernel by kernel (GPU): a decode step at a given batch and context, and a
prefill step, of a dummy model (Llama-3.1-8B unless --model) in one format, under torch.profiler. Prints per kernel name its launches
per step, us per step and share of the step, and per group (GEMM, attention, norm, ...) the sums.

The decode step is the captured graph's forward run eagerly on the graph's own input buffers, with every row
attending to `context` keys in shuffled blocks, its new K/V written at position context - 1; kernel times are device times, so the
host's launch cost does not enter. `python3 dev/bench/kernel_profile.py [--format fp8] [--decode 256x200,512x1500]
[--prefill 8192x2048] [--mixed 300x2100+7600x1900] [--json PATH]`
"""
import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench_cli import int_pairs  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.attention.paged_attention import long_context  # noqa: E402
from lowbit.serve.runner.context import StepContext  # noqa: E402

GROUPS = (  # (group, substrings of the kernel name), first match wins
    ("attention", ("_decode_kernel", "_combine_kernel", "_prefill")),
    ("moe", ("_gated_gemv", "_gate_up_silu", "_down_combine", "_route_kernel", "_router_topk", "_grouped_gemm")),
    ("rotary_kv_store", ("_rotary_store_kv",)),
    ("kv_store", ("_store_kv",)),
    ("gemm_triton", ("_fp8_small_m", "_w4", "_gemv", "_scaled_gemm", "_int8_gemm", "matmul_kernel")),
    ("gemm_cublas", ("gemm", "xmma", "cutlass", "sm90_", "nvjet", "splitKreduce")),
    ("norm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("activation", ("silu",)),
    ("act_quant", ("quant",)),
    ("sampling_logits", ("argmax", "softmax", "reduce", "max")),
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k.lower() in low for k in keys)), "other")


def profile(fn, steps: int) -> dict:
    """-> {kernel name: (launches, total us)} over `steps` calls of fn, after 3 warm-up calls."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.time_range.elapsed_us()
    return {k: (v[0] / steps, v[1] / steps) for k, v in kernels.items()}


def summarize(label: str, kernels: dict, top: int) -> dict:
    total = sum(us for _, us in kernels.values())
    groups = collections.Counter()
    for name, (_, us) in kernels.items():
        groups[group_of(name)] += us
    print(f"\n## {label}: {total / 1e3:.3f} ms of kernels per step")
    print("| group | us/step | share |\n|---|---|---|")
    for g, us in groups.most_common():
        print(f"| {g} | {us:.0f} | {100 * us / total:.1f} % |")
    print("| kernel | launches/step | us/step | us/launch | share |\n|---|---|---|---|---|")
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in rows[:top]:
        print(f"| {name[:90]} | {n:g} | {us:.0f} | {us / n:.1f} | {100 * us / total:.1f} % |")
    return {"label": label, "total_us": round(total, 1), "groups": {g: round(u, 1) for g, u in groups.items()},
            "kernels": [{"name": k, "launches": n, "us": round(u, 1)} for k, (n, u) in rows]}


def decode_step(engine, batch: int, context: int):
    """The graph's eager forward at `batch` rows, each attending to `context` keys in shuffled blocks."""
    g, r = engine.runner.graphs, engine.runner
    bs_ = engine.config.block_size
    per_seq = -(-context // bs_)
    if batch * per_seq > r.num_blocks or per_seq > g.block_tables.shape[1]:
        raise SystemExit(f"{batch}x{context}: needs {batch * per_seq} blocks, the pool has {r.num_blocks}")
    blocks = torch.randperm(r.num_blocks, device=r.device)[:batch * per_seq].to(torch.int32).view(batch, per_seq)
    g.block_tables[:batch, :per_seq].copy_(blocks)
    g.context_lens[:batch].fill_(context)
    g.positions[:batch].fill_(context - 1)
    g.slot_mapping[:batch].copy_(blocks[:, -1].long() * bs_ + (context - 1) % bs_)  # the new token's K/V
    g.input_ids[:batch].random_(0, engine.runner.model.config["vocab_size"])

    def step():
        with torch.inference_mode():
            long = batch in g.long_sizes and context > long_context(batch)
            g._forward(batch, long)  # the graph the engine would replay
    return step


def prefill_inputs(engine, batch: int, length: int):
    """-> input ids [batch * length] and the StepContext of one prefill step of `batch` whole prompts of `length`
    tokens (random ids, contiguous blocks)."""
    r, bs_ = engine.runner, engine.config.block_size
    n, per_seq, dev = batch * length, length // bs_, r.device
    ctx = StepContext(positions=torch.arange(length, device=dev).repeat(batch), slot_mapping=torch.arange(n, device=dev),
                      query_start_loc=torch.arange(0, n + 1, length, dtype=torch.int32, device=dev),
                      context_lens=torch.full((batch,), length, dtype=torch.int32, device=dev),
                      block_tables=torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq),
                      logits_indices=torch.arange(length - 1, n, length, device=dev), is_decode=False,
                      query_lens_cpu=[length] * batch, context_lens_cpu=[length] * batch)
    return torch.randint(0, r.model.config["vocab_size"], (n,), device=dev), ctx


def mixed_inputs(engine, decodes: int, context: int, tokens: int, length: int):
    """-> input ids and the StepContext of a mixed step as the scheduler builds one: `decodes` one-token sequences
    (each attending to `context` keys) first, then tokens // length whole prompts of `length` tokens; every
    sequence's blocks drawn at random from the pool."""
    r, bs_ = engine.runner, engine.config.block_size
    dev, prompts = r.device, tokens // length
    per_dec, per_prompt = -(-context // bs_), -(-length // bs_)
    need = decodes * per_dec + prompts * per_prompt
    if need > r.num_blocks:
        raise SystemExit(f"mixed {decodes}x{context}+{tokens}x{length}: needs {need} blocks, the pool has {r.num_blocks}")
    ids = torch.randperm(r.num_blocks, device=dev)[:need].to(torch.int32)
    width = -(-max(per_dec, per_prompt) // 16) * 16  # table rows padded to a multiple of 16 entries, as the engine's
    tables = torch.zeros(decodes + prompts, width, dtype=torch.int32, device=dev)
    if decodes:
        tables[:decodes, :per_dec] = ids[:decodes * per_dec].view(decodes, per_dec)
    tables[decodes:, :per_prompt] = ids[decodes * per_dec:].view(prompts, per_prompt)
    dec_pos = torch.full((decodes,), context - 1, device=dev)
    dec_slots = tables[:decodes, (context - 1) // bs_].long() * bs_ + (context - 1) % bs_
    pos = torch.arange(length, device=dev)
    prompt_slots = (tables[decodes:, pos // bs_].long() * bs_ + pos % bs_).reshape(-1)
    qlens, clens = [1] * decodes + [length] * prompts, [context] * decodes + [length] * prompts
    qsl = torch.tensor([0] + qlens, device=dev).cumsum(0).to(torch.int32)
    ctx = StepContext(positions=torch.cat([dec_pos, pos.repeat(prompts)]),
                      slot_mapping=torch.cat([dec_slots, prompt_slots]), query_start_loc=qsl,
                      context_lens=torch.tensor(clens, dtype=torch.int32, device=dev), block_tables=tables,
                      logits_indices=(qsl[1:] - 1).long(), is_decode=False, query_lens_cpu=qlens,
                      context_lens_cpu=clens)
    return torch.randint(0, r.model.config["vocab_size"], (decodes + tokens,), device=dev), ctx


def mixed_step(engine, decodes: int, context: int, tokens: int, length: int):
    model = engine.runner.model
    ids, ctx = mixed_inputs(engine, decodes, context, tokens, length)

    def step():
        with torch.inference_mode():
            model.compute_logits(model(ids, ctx)[ctx.logits_indices])
    return step


def prefill_step(engine, tokens: int, length: int):
    model = engine.runner.model
    ids, ctx = prefill_inputs(engine, tokens // length, length)

    def step():
        with torch.inference_mode():
            model.compute_logits(model(ids, ctx)[ctx.logits_indices])
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="fp8")
    p.add_argument("--model", default="llama-3.1-8b", help="whose shapes the dummy weights take (lowbit bench serve's)")
    p.add_argument("--decode", default="1x512,256x200,512x1500", help="BATCHxCONTEXT,...")
    p.add_argument("--prefill", default="8192x128,8192x2048", help="TOKENSxPROMPT_LENGTH,... ('' for none)")
    p.add_argument("--mixed", default="", help="DECODESxCONTEXT+TOKENSxPROMPT_LENGTH,...: mixed steps, decodes "
                   "first (as 2048/128's steps: 300x2100+7600x1900)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    sb = load_script("serve_bench.py")
    cases, fills = int_pairs(p, "--decode", a.decode), int_pairs(p, "--prefill", a.prefill)
    if any(tokens % length for tokens, length in fills):
        p.error(f"--prefill {a.prefill}: TOKENS must be a multiple of PROMPT_LENGTH")
    mixed = [int_pairs(p, "--mixed", spec.replace("+", ",")) for spec in filter(None, a.mixed.split(","))]
    if any(len(m) != 2 or m[1][0] % m[1][1] for m in mixed):
        p.error(f"--mixed {a.mixed}: expected DxC+TxL[,...] with TOKENS a multiple of PROMPT_LENGTH")
    max_batch = max([b for b, _ in cases] + [d + t // n for (d, _), (t, n) in mixed] + [1])
    max_tokens = max([t for t, _ in fills] + [d + t for (d, _), (t, _) in mixed] + [8192])
    engine = sb.build_engine(sb.parse(["--model", a.model, "--phases", "check", "--max-batch-size", str(max_batch),
                                       "--max-num-tokens", str(max_tokens)]),
                             a.format)
    out = []
    for batch, context in cases:
        out.append(summarize(f"{a.format} decode batch {batch}, context {context}",
                             profile(decode_step(engine, batch, context), a.steps), a.top))
    for tokens, length in fills:
        out.append(summarize(f"{a.format} prefill {tokens // length} x {length} tokens",
                             profile(prefill_step(engine, tokens, length), a.steps), a.top))
    for dec, pre in mixed:
        out.append(summarize(f"{a.format} mixed step: {dec[0]} decodes of context {dec[1]} + {pre[0] // pre[1]} x "
                             f"{pre[1]} prompt tokens", profile(mixed_step(engine, *dec, *pre), a.steps), a.top))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
