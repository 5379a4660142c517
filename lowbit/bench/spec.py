"""`lowbit bench spec`: what speculative decoding costs and gives, on dummy weights (Llama-3.1-8B shapes, FP8) or a
real checkpoint.

1. The verify step: one forward of k + 1 tokens per sequence (k drafted) over the paged KV at a context of
   --context tokens, for k = 1..8 at each batch size, against the plain decode step (k = 0), both as the engine runs
   them (replayed from CUDA graphs on a GPU), and the verify step run eagerly for comparison. From the graphed
   ratios r(b, k): a drafter accepting each token with probability a emits (1 - a^(k+1)) / (1 - a) tokens per step,
   so its speed-up is that over r; printed per batch size: the break-even acceptance (the a where the best k makes
   speculation pay) and the speed-up at a = 0.5 / 0.7 / 0.9. The auto-off threshold (`speculative_max_batch_size`)
   is the largest batch size whose break-even acceptance is below the workload's measured acceptance.
2. Tokens/s at --tps-batch-sizes on a quote-heavy workload (each request's prompt repeats a passage; greedy) with
   n-gram drafting vs without, the same engine and weights, the auto-off lifted; whether every output is identical,
   the acceptance, and the largest batch size where speculation still paid. Random weights rarely copy their
   prompt, so their acceptance is low; `--model NAME` runs this part on a real checkpoint instead (a prompt asking
   it to repeat a passage), where acceptance is what real text gives.
3. With --model and --draft-model: the same runs with the draft model drafting (e.g. the int4_awq copy of an fp8
   target). --batch1-only skips part 1 (with --model).
--host-only: instead, the host's work per token on the CPU, model forward stubbed (lowbit/bench/spec_host.py).
"""
import argparse
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone

import torch

from lowbit.bench.serve_bench import LLAMA_3_1_8B, TINY, DummyTokenizer, free, sync
from lowbit.bench_cli import int_list, json_lines
from lowbit.progress import stage
from lowbit.serve.engine.config import DEFAULT_NUM_DRAFT_TOKENS, EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.scheduler import Batch
from lowbit.serve.engine.sequence import Sequence
from lowbit.serve.spec.decoder import SpecDecoder
from lowbit.serve.spec.ngram import NgramDrafter
from lowbit.testing.dummy_weights import FORMATS, dummy_checkpoint

ACCEPTANCES = (0.5, 0.7, 0.9)  # per-token acceptance rates the verify table translates into speed-ups


def parse(argv):
    p = argparse.ArgumentParser(prog="lowbit bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="fp8", choices=sorted(FORMATS))
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="batch sizes of the verify-step table")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="drafted tokens per sequence")
    p.add_argument("--tps-batch-sizes", default="1,4,16,64", help="batch sizes of the tokens/s runs")
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence's KV")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per point (median)")
    p.add_argument("--passage", type=int, default=128, help="tokens of the passage the workload's prompt repeats")
    p.add_argument("--output-len", type=int, default=256, help="greedy tokens generated per request")
    p.add_argument("--num-draft-tokens", type=int, help="k of the tokens/s runs (default: the engine's, by drafter)")
    p.add_argument("--speculative-max-batch-size", type=int,
                   help="the tokens/s runs' auto-off batch size (default: the largest --tps-batch-sizes, i.e. lifted; "
                        "the engine's own default is EngineConfig's)")
    p.add_argument("--model", help="part 2 on this checkpoint (store name or directory) instead of dummy weights")
    p.add_argument("--draft-model", help="part 3: this checkpoint drafts for --model (same tokenizer)")
    p.add_argument("--batch1-only", "--no-verify-table", dest="batch1_only", action="store_true",
                   help="skip part 1 (the verify-step table)")
    p.add_argument("--no-eager", action="store_true", help="part 1 without the eager verify-step timings")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 model (CPU smoke test)")
    p.add_argument("--host-only", action="store_true",
                   help="host work per token, plain vs n-gram, model forward stubbed (CPU; --repeats runs each)")
    p.add_argument("--step-costs", choices=["h200"],
                   help="with --host-only: time on a clock that advances by the H200's measured step costs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the JSON lines here")
    args = p.parse_args(argv)
    for flag in ("batch_sizes", "ks", "tps_batch_sizes"):
        setattr(args, flag, int_list(p, "--" + flag.replace("_", "-"), getattr(args, flag)))
    for flag in ("context", "repeats", "passage", "output_len", "num_draft_tokens", "speculative_max_batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.draft_model and not args.model:
        p.error("--draft-model needs --model (the target it drafts for)")
    if args.step_costs and not args.host_only:
        p.error("--step-costs needs --host-only")
    if args.host_only and (args.model or args.tiny):
        p.error("--host-only stubs the model: no --model or --tiny")
    if args.batch1_only and not args.model:
        p.error("--batch1-only needs --model (part 2 on dummy weights uses part 1's engine)")
    return args


def build(args) -> Engine:
    """Dummy weights; on a GPU, verify graphs for every batch size measured and q = k + 1 of every k measured (a
    step with fewer drafts runs in the next q up)."""
    config = dict(TINY if args.tiny else LLAMA_3_1_8B)
    ckpt = dummy_checkpoint(args.format, config, device=args.device)
    most = max(args.batch_sizes + args.tps_batch_sizes)
    need = most * -(-(max(args.context, prompt_len(args) + args.output_len) + max(args.ks) + 1) // 16) + 64
    cfg = EngineConfig(max_batch_size=most, max_num_tokens=max(2048, most * 9), num_kv_blocks=need,
                       device=args.device, dtype="float32" if args.tiny else "bfloat16",
                       max_model_len=args.context + prompt_len(args) + args.output_len + 64,
                       speculative_max_batch_size=most)
    with torch.device(args.device):
        engine = Engine(ckpt.path, cfg, ckpt=ckpt, tokenizer=DummyTokenizer())
    if engine.runner.graphs is not None:
        with stage("capturing verify CUDA graphs"):
            engine.runner.verify_graphs = engine.runner.capture_verify_graphs(
                sorted({k + 1 for k in args.ks} | {ngram_k(args) + 1}))
    return engine


PASSAGE = ("The committee met on Tuesday to review the budget. It agreed to fund the new library wing, to delay the "
           "road repairs until spring, and to ask the county for a second grant. The chair thanked the volunteers "
           "who had counted the survey forms by hand.")


CHAT = ["Write a short story about a robot who learns to paint.", "What are the benefits of regular exercise?",
        "Explain how a rainbow forms.", "Give me three tips for learning a new language.",
        "Why do cats purr?", "Describe a good breakfast for a busy morning.", "How does a bicycle stay upright?",
        "What should I pack for a weekend trip to the mountains?"]


def real_engine(args, draft: bool = False) -> tuple[Engine, dict[str, list[list[int]]]]:
    """The checkpoint --model (drafted for by --draft-model when draft, else by n-grams) and, per workload, a prompt
    per request of the largest batch (its own tokenizer): `quote` asks it to repeat a passage, `chat` asks an
    open question (nothing to copy but what the answer repeats of itself)."""
    spec = dict(speculative="draft", draft_model=args.draft_model) if draft else dict(speculative="ngram")
    most = max(args.tps_batch_sizes)
    cfg = EngineConfig(max_batch_size=most, speculative_max_batch_size=spec_cap(args), device=args.device,
                       num_draft_tokens=args.num_draft_tokens, **spec)
    engine = Engine(args.model, cfg)
    quote = [f"Request {i}. Passage: {PASSAGE}\nRepeat the passage word for word.\nPassage: {PASSAGE}\n"
             f"Again, word for word:\n" for i in range(most)]
    chat = [f"User: {CHAT[i % len(CHAT)]} (request {i})\nAssistant:" for i in range(most)]
    return engine, {name: [engine.tokenizer.encode(t) for t in texts] for name, texts in (("quote", quote),
                                                                                          ("chat", chat))}


def prompt_len(args) -> int:
    return 2 * args.passage + args.passage // 2


def synthetic_prompts(engine: Engine, args) -> list[list[int]]:
    """Per request of the largest batch: a random passage, half of it, then all of it again (it quotes itself)."""
    vocab = engine.runner.model.config["vocab_size"]
    out = []
    for i in range(max(args.tps_batch_sizes)):
        passage = torch.randint(0, vocab, (args.passage,), generator=torch.Generator().manual_seed(1 + i)).tolist()
        out.append(passage + passage[: args.passage // 2] + passage)
    return out


def step_ms(engine: Engine, batch_size: int, k: int, context: int, repeats: int) -> float:
    """Median ms of one forward of k + 1 new tokens for each of batch_size sequences at `context` (k = 0: a plain
    decode step), as the runner runs it. The sequences' blocks are taken from the engine's pool and given back."""
    vocab, bm = engine.runner.model.config["vocab_size"], engine.block_manager
    gen = torch.Generator().manual_seed(batch_size * 100 + k)
    seqs = []
    for _ in range(batch_size):
        seq = Sequence(torch.randint(0, vocab, (context + k + 1,), generator=gen).tolist(), SamplingParams())
        bm.allocate(seq, [], context + k + 1)
        seq.num_computed_tokens = context  # the K/V there are whatever the pool holds: timing only
        seqs.append(seq)
    batch = Batch(seqs, [k + 1] * batch_size)
    rows = [list(range(k + 1))] * batch_size
    times = []
    for i in range(repeats + 3):  # 3 warm-up steps
        sync()
        t0 = time.perf_counter()
        engine.runner.run(batch, rows)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    for seq in seqs:
        bm.deallocate(seq)
    return 1e3 * statistics.median(times)


def tokens_per_step(a: float, k: int) -> float:
    """Expected tokens a verify step emits with k drafts, each accepted with probability a (until the first miss)."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def break_even(ratio: float, k: int) -> float:
    """The acceptance a at which k drafts per step pay exactly (tokens_per_step(a, k) == ratio); 1.0: never."""
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_step(mid, k) < ratio else (lo, mid)
    return hi


def verify_table(args, emit) -> Engine:
    """Part 1: the verify step's cost by batch size and k against a plain decode step; returns its engine."""
    engine = build(args)
    model = "tiny" if args.tiny else "Llama-3.1-8B shapes, dummy weights"
    graphed = engine.runner.verify_graphs is not None
    print(f"verify step {'(CUDA graphs)' if graphed else '(eager: no CUDA graphs here)'} vs the decode step, "
          f"context {args.context}: ms (x decode)")
    print("| batch | decode ms | " + " | ".join(f"k={k}" for k in args.ks) + " | eager x (" +
          ", ".join(f"k={k}" for k in args.ks) + ") |")
    print("|---|---|" + "---|" * len(args.ks) + "---|")
    rows = []
    for b in args.batch_sizes:
        base = step_ms(engine, b, 0, args.context, args.repeats)
        cost = {k: step_ms(engine, b, k, args.context, args.repeats) for k in args.ks}
        eager = {} if args.no_eager or not graphed else eager_costs(engine, b, args)
        emit({"bench": "spec-verify", "model": model, "format": args.format, "batch": b, "context": args.context,
              "graphed": graphed, "decode_ms": base, **{f"verify_k{k}_ms": v for k, v in cost.items()},
              **{f"eager_verify_k{k}_ms": v for k, v in eager.items()}})
        print(f"| {b} | {base:.3f} | " + " | ".join(f"{cost[k]:.3f} ({cost[k] / base:.2f})" for k in args.ks) +
              " | " + (", ".join(f"{eager[k] / base:.2f}" for k in args.ks) if eager else "-") + " |")
        rows.append((b, {k: cost[k] / base for k in args.ks}))
    print_break_even(rows, emit)
    return engine


def eager_costs(engine: Engine, b: int, args) -> dict[int, float]:
    runner, graphs = engine.runner, engine.runner.verify_graphs
    runner.verify_graphs = None
    try:
        return {k: step_ms(engine, b, k, args.context, args.repeats) for k in args.ks}
    finally:
        runner.verify_graphs = graphs


def print_break_even(rows, emit) -> None:
    """Per batch size: the break-even acceptance (best k) and the speed-up at ACCEPTANCES (best k each)."""
    print("what the verify costs give a drafter with per-token acceptance a (best k each):")
    print("| batch | break-even a (k) | " + " | ".join(f"speed-up at a={a} (k)" for a in ACCEPTANCES) + " |")
    print("|---|---|" + "---|" * len(ACCEPTANCES))
    for b, ratios in rows:
        even_k = min(ratios, key=lambda k: break_even(ratios[k], k))
        best = {a: max(ratios, key=lambda k: tokens_per_step(a, k) / ratios[k]) for a in ACCEPTANCES}
        gain = {a: tokens_per_step(a, best[a]) / ratios[best[a]] for a in ACCEPTANCES}
        emit({"bench": "spec-break-even", "batch": b, "break_even_acceptance": break_even(ratios[even_k], even_k),
              "break_even_k": even_k, **{f"speedup_a{a}": gain[a] for a in ACCEPTANCES},
              **{f"best_k_a{a}": best[a] for a in ACCEPTANCES}})
        print(f"| {b} | {break_even(ratios[even_k], even_k):.2f} ({even_k}) | " +
              " | ".join(f"{gain[a]:.2f} ({best[a]})" for a in ACCEPTANCES) + " |")


def run_batch(engine: Engine, prompts: list[list[int]], output_len: int, decoder) -> tuple[float, list, object]:
    """(tokens/s (on the CPU: per process CPU second), outputs, decoder) of greedy requests for every prompt at once,
    speculating with decoder (None: not; its counters start at zero, its policy keeps what it learnt), after a
    short warm-up batch of the same prompts (the kernels' first launches at this batch's prefill and verify shapes
    compile outside the timed run; with prefix caching on, the timed prompts then hit the cache, so both runs
    measure mostly decode)."""
    engine.spec = decoder
    for i, p in enumerate(prompts):
        engine.add_request(f"warm-{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    if decoder is not None:
        decoder.num_steps = decoder.num_verified = decoder.num_drafted = decoder.num_accepted = 0
        decoder.recent.clear()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    clock = time.perf_counter if engine.runner.device.type == "cuda" else time.process_time  # CPU: shared machine
    sync()
    t0, out = clock(), {}
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, params, stream=False)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    sync()
    return len(prompts) * output_len / (clock() - t0), [out[i] for i in ids], decoder


def divergences(engine: Engine, prompts: list[list[int]], plain: list, others: list[list]) -> list[tuple]:
    """(request, position, gap) for every request some other run's greedy tokens leave plain's: the first position
    where one does, and the gap in nats between the two best tokens there, scored by one prefill of the prompt and
    plain's tokens before it (a near-tie: a gap that kernels of other shapes can flip by rounding)."""
    firsts = {}
    for r, tokens in enumerate(plain):
        at = [next((i for i, (a, b) in enumerate(zip(tokens, o[r])) if a != b), None) for o in others]
        at = [i for i in at if i is not None]
        if at:
            firsts[r] = min(at)
    decoder, engine.spec = engine.spec, None
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=2)
    ids = {f"gap{time.monotonic_ns()}-{r}": r for r in firsts}
    gaps = {}
    try:
        for rid, r in ids.items():
            engine.add_request(rid, prompts[r] + plain[r][:firsts[r]], params, stream=False)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished and o.request_id in ids:
                    top = o.outputs[0].logprobs[0][1]
                    gaps[ids[o.request_id]] = top[0][1] - top[1][1]
    finally:
        engine.spec = decoder
    return [(r, firsts[r], gaps[r]) for r in sorted(firsts)]


def spec_cap(args) -> int:
    return args.speculative_max_batch_size or max(args.tps_batch_sizes)


def ngram_k(args) -> int:
    return args.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS["ngram"]


def tps_runs(engine: Engine, prompts, args, drafter, name: str, emit, model: str, k: int,
             workload: str = "quote") -> bool:
    """Part 2 / 3: plain vs speculative tokens/s at each --tps-batch-sizes (the auto-off lifted): speculating at every
    step (pausing sequences whose drafts miss: no policy), and with the policy (the engine's way), its first run
    (cold: it learns) and a second with what it learnt (warm); whether every output was identical."""
    config = replace(engine.config, num_draft_tokens=k, speculative_max_batch_size=spec_cap(args))
    print(f"tokens/s, {workload} prompts, greedy, {args.output_len} tokens each, {name} k={k}, "
          f"speculative_max_batch_size={spec_cap(args)}:")
    print("| batch | plain tok/s | no policy | x | policy, cold | x | policy, warm | x | acceptance | tokens/step | "
          "verify steps (warm) | identical | first difference (largest top-2 gap there) | plain = plain at the "
          "previous batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_same, pays_up_to, paying, previous = True, 0, True, []
    for b in args.tps_batch_sizes:
        plain_tps, plain, _ = run_batch(engine, prompts[:b], args.output_len, None)
        invariant = sum(a == p for a, p in zip(plain, previous))
        invariant_text = f"{invariant}/{len(previous)}" if previous else "-"
        previous = plain
        fixed_tps, fixed, s = run_batch(engine, prompts[:b], args.output_len,
                                        SpecDecoder(drafter, config, adaptive=False))
        policy = SpecDecoder(drafter, config)
        cold_tps, cold, _ = run_batch(engine, prompts[:b], args.output_len, policy)
        spec_tps, spec, _ = run_batch(engine, prompts[:b], args.output_len, policy)
        same = sum(w == x == y == z for w, x, y, z in zip(plain, fixed, cold, spec))
        diverged = divergences(engine, prompts[:b], plain, [fixed, cold, spec])
        where = (f"token {min(d[1] for d in diverged)} ({max(d[2] for d in diverged):.3f} nats)" if diverged
                 else "-")
        rate = s.num_accepted / s.num_drafted if s.num_drafted else 0.0
        per_step = 1 + s.num_accepted / s.num_verified if s.num_verified else 1.0
        enabled = sum(policy.recent) / len(policy.recent) if policy.recent else 0.0
        x = [t / plain_tps for t in (fixed_tps, cold_tps, spec_tps)]
        emit({"bench": "spec-tps", "model": model, "workload": workload, "drafter": name, "batch": b,
              "num_draft_tokens": k, "output_len": args.output_len, "plain_tok_s": plain_tps,
              "no_policy_tok_s": fixed_tps, "cold_tok_s": cold_tps, "spec_tok_s": spec_tps, "speedup": x[2],
              "no_policy_speedup": x[0], "cold_speedup": x[1], "acceptance_rate": rate, "tokens_per_step": per_step,
              "enabled_fraction": enabled, "identical_outputs": same, "requests": b,
              "divergences": [{"request": r, "position": at, "top2_gap_nats": g} for r, at, g in diverged],
              "plain_same_as_previous_batch": invariant_text})
        print(f"| {b} | {plain_tps:.1f} | {fixed_tps:.1f} | {x[0]:.2f} | {cold_tps:.1f} | {x[1]:.2f} | "
              f"{spec_tps:.1f} | {x[2]:.2f} | {rate:.2f} | {per_step:.2f} | {enabled:.2f} | {same}/{b} | {where} | "
              f"{invariant_text} |")
        all_same &= same == b
        paying &= fixed_tps >= plain_tps
        pays_up_to = b if paying else pays_up_to
    if pays_up_to:
        print(f"auto-off: {name} paid at every batch size up to {pays_up_to} here: set speculative_max_batch_size "
              f"from it (between the measured sizes: part 1's break-even acceptance against acceptance {rate:.2f})")
    else:
        print(f"auto-off: {name} did not pay at batch {args.tps_batch_sizes[0]} here")
    return all_same


def main(argv=None) -> int:
    args = parse(argv)
    argv = sys.argv[1:] if argv is None else argv
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"command: lowbit bench spec {' '.join(argv)}")
    print(f"machine: {device}, torch {torch.__version__}")
    print(f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    emit, _ = json_lines(args.json)
    if args.host_only:
        from lowbit.bench.spec_host import run
        return 0 if run(args, emit) else 1
    engine = None if args.batch1_only else verify_table(args, emit)
    if not args.model:
        prompts, model = synthetic_prompts(engine, args), "tiny" if args.tiny else "Llama-3.1-8B shapes, dummy weights"
        ok = tps_runs(engine, prompts, args, NgramDrafter(engine.config.ngram_size), "n-gram", emit, model,
                      ngram_k(args))
        return 0 if ok else 1
    del engine
    free()
    engine, workloads = real_engine(args)
    ok = all([tps_runs(engine, prompts, args, NgramDrafter(engine.config.ngram_size), "n-gram", emit, args.model,
                       ngram_k(args), workload) for workload, prompts in workloads.items()])
    if args.draft_model:
        del engine
        free()
        engine, workloads = real_engine(args, draft=True)
        ok &= all([tps_runs(engine, prompts, args, engine.spec.drafter, f"drafted by {args.draft_model}", emit,
                            args.model, engine.config.num_draft_tokens, workload)
                   for workload, prompts in workloads.items()])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
