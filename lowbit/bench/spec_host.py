"""`lowbit bench spec --host-only`: the host's work per generated token with and without n-gram drafting, the model
forward stubbed out (CPU).

The stub's greedy token at position p is script[p + 1] whatever the input, so a workload is a script: `quote` repeats
one passage (the prompt holds it once and a half: every continuation is a quote, acceptance ~1), `chat` is fresh
tokens with a span quoted from earlier text every `CHAT_PERIOD` tokens (most drafts are rejected). Every request of
a batch follows the same script. What is timed (process CPU time) is the engine's host work: scheduling, step
inputs, drafting, verification, rollback, detokenizing and outputs; on a GPU it comes on top of the forward in a
speculative step (the host waits for the verify step's tokens) and hides behind it in plain decoding (overlapped
steps). So the speed-up here bounds what host work allows; a model with negligible compute would reach it.
"""
import time

import torch

from lowbit.bench.engine_overhead import TINY, DummyTokenizer
from lowbit.serve.engine.config import DEFAULT_NUM_DRAFT_TOKENS, EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.spec.decoder import SpecDecoder
from lowbit.serve.spec.ngram import NgramDrafter
from lowbit.testing.dummy_weights import dummy_checkpoint

VOCAB = 512
CHAT_PERIOD, CHAT_QUOTE = 32, 8  # chat: every 32 tokens, 8 copied from earlier in the script


class ScriptedModel:
    """The model's interface without its work: hidden state = position; logits pick script[position + 1]."""

    def __init__(self, config: dict, script: list[int]):
        self.config = config
        self.table = torch.full((len(script), VOCAB), -10.0)
        self.table[torch.arange(len(script) - 1), torch.tensor(script[1:])] = 10.0

    def __call__(self, input_ids, ctx):
        return ctx.positions.view(-1, 1)

    def compute_logits(self, hidden):
        return self.table[hidden[:, 0]]


def script(workload: str, passage: int, length: int) -> tuple[list[int], int]:
    """(the tokens, the prompt length) of a workload."""
    gen = torch.Generator().manual_seed(0)
    fresh = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
    if workload == "quote":
        return (fresh[:passage] * (-(-length // passage)))[:length], passage + passage // 2
    tokens = fresh[:2 * passage]
    while len(tokens) < length:
        start = int(torch.randint(0, len(tokens) - CHAT_QUOTE, (1,), generator=gen))
        tokens += fresh[len(tokens):len(tokens) + CHAT_PERIOD - CHAT_QUOTE] + tokens[start:start + CHAT_QUOTE]
    return tokens[:length], 2 * passage


def engine_for(args, workload: str) -> tuple[Engine, list[int]]:
    tokens, prompt_len = script(workload, args.passage, args.passage * 2 + args.output_len + 64)
    most = max(args.tps_batch_sizes)
    ckpt = dummy_checkpoint("bf16", dict(TINY, vocab_size=VOCAB, max_position_embeddings=len(tokens)), device="cpu")
    config = EngineConfig(max_batch_size=most, num_kv_blocks=most * (len(tokens) // 16 + 2), device="cpu",
                          dtype="float32", speculative="ngram", num_draft_tokens=args.num_draft_tokens,
                          speculative_max_batch_size=most)
    engine = Engine(ckpt.path, config, ckpt=ckpt, tokenizer=DummyTokenizer())
    engine.runner.model = ScriptedModel(ckpt.config, tokens)
    return engine, tokens[:prompt_len]


def timed_run(engine: Engine, prompt: list[int], batch: int, output_len: int, decoder) -> tuple[float, list]:
    """(CPU seconds, outputs) of `batch` streamed greedy requests decoding output_len tokens each."""
    engine.spec = decoder
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(batch)]
    t0, done = time.process_time(), {}
    for i in ids:
        engine.add_request(i, prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return time.process_time() - t0, [done[i] for i in ids]


def run(args, emit) -> bool:
    """Per workload and batch size: host tokens/s plain, n-gram without and with pausing (the engine's way)."""
    print(f"host-only tokens/s (process CPU time, model forward stubbed), greedy, {args.output_len} tokens each, "
          f"n-gram k={args.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS['ngram']}: best of {args.repeats}")
    print("| workload | batch | plain tok/s | n-gram, no pausing | n-gram tok/s | speed-up | acceptance | "
          "tokens/step | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for workload in ("quote", "chat"):
        engine, prompt = engine_for(args, workload)
        timed_run(engine, prompt, 1, 16, None)  # first-step costs outside the timing
        for b in args.tps_batch_sizes:
            tps, same, decoders = {}, True, {}
            for name, make in (("plain", lambda: None), ("no_pausing", lambda: decoder(engine, False)),
                               ("spec", lambda: decoder(engine, True))):
                times = []
                for _ in range(args.repeats):
                    decoders[name] = make()
                    seconds, out = timed_run(engine, prompt, b, args.output_len, decoders[name])
                    times.append(seconds)
                    reference = out if name == "plain" else reference
                    same &= out == reference
                tps[name] = b * args.output_len / min(times)  # the least disturbed run (a shared machine)
            s = decoders["spec"]
            rate = s.num_accepted / s.num_drafted if s.num_drafted else 0.0
            per_step = 1 + s.num_accepted / s.num_verified if s.num_verified else 1.0  # per sequence and step
            emit({"bench": "spec-host", "workload": workload, "batch": b,
                  "num_draft_tokens": engine.config.num_draft_tokens,
                  "output_len": args.output_len, "plain_tok_s": tps["plain"], "no_pausing_tok_s": tps["no_pausing"],
                  "spec_tok_s": tps["spec"], "speedup": tps["spec"] / tps["plain"],
                  "acceptance_rate": rate, "tokens_per_step": per_step, "identical_outputs": same})
            print(f"| {workload} | {b} | {tps['plain']:.0f} | {tps['no_pausing']:.0f} | {tps['spec']:.0f} | "
                  f"{tps['spec'] / tps['plain']:.2f} | {rate:.2f} | {per_step:.2f} | {'yes' if same else 'NO'} |")
            ok &= same
    return ok


def decoder(engine: Engine, pausing: bool) -> SpecDecoder:
    return SpecDecoder(NgramDrafter(engine.config.ngram_size), engine.config, pausing=pausing)
