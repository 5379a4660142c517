"""`lowbit bench spec`: what speculative decoding costs and gives, on dummy weights (Llama-3.1-8B shapes, FP8).

1. The verify step: one forward of k + 1 tokens per sequence (k drafted) over the paged KV at a context of
   --context tokens, for k = 1..8 at each batch size, against the plain decode step (k = 0, replayed from CUDA graphs
   where the engine would). Speed-up of a real drafter at acceptance a per token: tokens per step
   (1 - a^(k+1)) / (1 - a) over the step's cost ratio; the batch size past which no k pays is the auto-off threshold
   (`speculative_max_batch_size`).
2. Batch 1 on a repetitive, quote-heavy workload (a prompt that repeats a passage; greedy): tokens/s with n-gram
   drafting vs without, the same engine and weights, and whether the outputs are identical. Random weights rarely
   copy their prompt, so their acceptance is low; `--model NAME` runs this part on a real checkpoint instead (a
   prompt asking it to repeat a passage), where acceptance is what real text gives.
3. With --model and --draft-model: the same batch-1 request with the draft model drafting (e.g. the int4_awq copy of
   an fp8 target): tokens/s, acceptance and whether the output is identical. --batch1-only skips part 1.
"""
import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from lowbit.bench.serve_bench import LLAMA_3_1_8B, TINY, DummyTokenizer, free, sync
from lowbit.bench_cli import int_list, json_lines
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.scheduler import Batch
from lowbit.serve.engine.sequence import Sequence
from lowbit.serve.spec.decoder import SpecDecoder, make_decoder
from lowbit.testing.dummy_weights import FORMATS, dummy_checkpoint


def parse(argv):
    p = argparse.ArgumentParser(prog="lowbit bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="fp8", choices=sorted(FORMATS))
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="drafted tokens per sequence")
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence's KV")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per point (median)")
    p.add_argument("--passage", type=int, default=128, help="tokens of the passage the workload's prompt repeats")
    p.add_argument("--output-len", type=int, default=256, help="greedy tokens generated at batch 1")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k of the batch-1 n-gram run")
    p.add_argument("--model", help="part 2 on this checkpoint (store name or directory) instead of dummy weights")
    p.add_argument("--draft-model", help="part 3: this checkpoint drafts for --model (same tokenizer)")
    p.add_argument("--batch1-only", action="store_true", help="skip part 1 (the verify-step table)")
    p.add_argument("--tiny", action="store_true", help="a tiny fp32 model (CPU smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the JSON lines here")
    args = p.parse_args(argv)
    args.batch_sizes = int_list(p, "--batch-sizes", args.batch_sizes)
    args.ks = int_list(p, "--ks", args.ks)
    for flag in ("context", "repeats", "passage", "output_len", "num_draft_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.draft_model and not args.model:
        p.error("--draft-model needs --model (the target it drafts for)")
    if args.batch1_only and not args.model:
        p.error("--batch1-only needs --model (part 2 on dummy weights uses part 1's engine)")
    return args


def build(args) -> Engine:
    config = dict(TINY if args.tiny else LLAMA_3_1_8B)
    ckpt = dummy_checkpoint(args.format, config, device=args.device)
    need = max(args.batch_sizes) * -(-(args.context + max(args.ks) + 1) // 16) + 64
    cfg = EngineConfig(max_batch_size=max(args.batch_sizes), max_num_tokens=max(2048, max(args.batch_sizes) * 9),
                       num_kv_blocks=need, device=args.device, dtype="float32" if args.tiny else "bfloat16",
                       max_model_len=args.context + 2 * args.passage + args.output_len + 64,
                       speculative="ngram", num_draft_tokens=args.num_draft_tokens)
    with torch.device(args.device):
        return Engine(ckpt.path, cfg, ckpt=ckpt, tokenizer=DummyTokenizer())


PASSAGE = ("The committee met on Tuesday to review the budget. It agreed to fund the new library wing, to delay the "
           "road repairs until spring, and to ask the county for a second grant. The chair thanked the volunteers "
           "who had counted the survey forms by hand.")


def real_engine(args, draft: bool = False) -> tuple[Engine, list[int]]:
    """The checkpoint --model (drafted for by --draft-model when draft, else by n-grams) and a prompt that asks it to
    repeat a passage (its own tokenizer)."""
    spec = dict(speculative="draft", draft_model=args.draft_model) if draft else dict(speculative="ngram")
    cfg = EngineConfig(max_batch_size=1, device=args.device, num_draft_tokens=args.num_draft_tokens, **spec)
    engine = Engine(args.model, cfg)
    text = f"Passage: {PASSAGE}\nRepeat the passage word for word.\nPassage: {PASSAGE}\nAgain, word for word:\n"
    return engine, engine.tokenizer.encode(text)


def step_ms(engine: Engine, batch_size: int, k: int, context: int, repeats: int) -> float:
    """Median ms of one forward of k + 1 new tokens for each of batch_size sequences at `context` (k = 0: a plain
    decode step). The sequences' blocks are taken from the engine's pool and given back."""
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


def synthetic_prompt(engine: Engine, args) -> list[int]:
    """A random passage, half of it, then all of it again: a prompt that quotes itself."""
    vocab = engine.runner.model.config["vocab_size"]
    passage = torch.randint(0, vocab, (args.passage,), generator=torch.Generator().manual_seed(1)).tolist()
    return passage + passage[: args.passage // 2] + passage


def batch1(engine: Engine, args, prompt: list[int], decoder) -> tuple[float, list[int]]:
    """(tokens/s, output) of one greedy request on the repetitive prompt, speculating with decoder (None: not)."""
    engine.spec = decoder
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sync()
    t0, out = time.perf_counter(), None
    engine.add_request("r", prompt, params, stream=False)
    while engine.has_unfinished():
        for o in engine.step():
            out = o.outputs[0].token_ids if o.finished else out
    sync()
    return args.output_len / (time.perf_counter() - t0), out


def main(argv=None) -> int:
    args = parse(argv)
    argv = sys.argv[1:] if argv is None else argv
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"command: lowbit bench spec {' '.join(argv)}")
    print(f"machine: {device}, torch {torch.__version__}")
    print(f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    emit, _ = json_lines(args.json)
    engine = None if args.batch1_only else verify_table(args, emit)
    if args.model:
        del engine
        free()
        engine, prompt = real_engine(args)
        model = args.model
    else:
        prompt, model = synthetic_prompt(engine, args), "tiny" if args.tiny else "Llama-3.1-8B shapes, dummy weights"
    plain_tps, plain = batch1(engine, args, prompt, None)
    spec_tps, spec = batch1(engine, args, prompt, make_decoder(engine.config))
    s = engine.spec
    emit({"bench": "spec-batch1", "model": model, "format": "checkpoint's" if args.model else args.format, "num_draft_tokens": args.num_draft_tokens,
          "output_len": args.output_len, "plain_tok_s": plain_tps, "ngram_tok_s": spec_tps,
          "speedup": spec_tps / plain_tps, "acceptance_rate": s.num_accepted / s.num_drafted if s.num_drafted else 0.0,
          "accepted_per_step": s.num_accepted / s.num_verified if s.num_verified else 0.0,
          "identical_output": plain == spec})
    print(f"batch 1, repetitive prompt, greedy: {plain_tps:.1f} tok/s plain, {spec_tps:.1f} tok/s n-gram "
          f"(k={args.num_draft_tokens}), outputs {'identical' if plain == spec else 'DIFFERENT'}")
    draft_ok = True
    if args.draft_model:
        del engine, s
        free()
        draft_ok = draft_batch1(args, model, plain, plain_tps, emit)
    return 0 if plain == spec and draft_ok else 1


def draft_batch1(args, model: str, plain: list[int], plain_tps: float, emit) -> bool:
    """Part 3: the batch-1 request with --draft-model drafting; whether its output is plain decoding's."""
    engine, prompt = real_engine(args, draft=True)
    draft_tps, out = batch1(engine, args, prompt, SpecDecoder(engine.spec.drafter, engine.config))
    s, draft_ok = engine.spec, out == plain
    emit({"bench": "spec-batch1-draft", "model": model, "draft_model": args.draft_model,
          "num_draft_tokens": args.num_draft_tokens, "output_len": args.output_len, "plain_tok_s": plain_tps,
          "draft_tok_s": draft_tps, "speedup": draft_tps / plain_tps,
          "acceptance_rate": s.num_accepted / s.num_drafted if s.num_drafted else 0.0,
          "accepted_per_step": s.num_accepted / s.num_verified if s.num_verified else 0.0,
          "identical_output": draft_ok})
    print(f"batch 1, repetitive prompt, greedy: {draft_tps:.1f} tok/s drafted by {args.draft_model} "
          f"(k={args.num_draft_tokens}, acceptance {s.num_accepted / max(1, s.num_drafted):.2f}), output "
          f"{'identical' if draft_ok else 'DIFFERENT'} to plain decoding")
    return draft_ok


def verify_table(args, emit) -> Engine:
    """Part 1: the verify step's cost by batch size and k against a plain decode step; returns its engine."""
    engine = build(args)
    model = "tiny" if args.tiny else "Llama-3.1-8B shapes, dummy weights"
    print("| batch | decode ms | " + " | ".join(f"k={k} ms (x)" for k in args.ks) + " |")
    print("|---|---|" + "---|" * len(args.ks))
    for b in args.batch_sizes:
        base = step_ms(engine, b, 0, args.context, args.repeats)
        cost = {k: step_ms(engine, b, k, args.context, args.repeats) for k in args.ks}
        emit({"bench": "spec-verify", "model": model, "format": args.format, "batch": b, "context": args.context,
              "decode_ms": base, **{f"verify_k{k}_ms": v for k, v in cost.items()}})
        print(f"| {b} | {base:.3f} | " + " | ".join(f"{cost[k]:.3f} ({cost[k] / base:.2f})" for k in args.ks) + " |")
    return engine


if __name__ == "__main__":
    sys.exit(main())
