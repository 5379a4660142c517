"""`lowbit bench spec --host-only`: the host's work per generated token with and without n-gram drafting, the model
forward stubbed out (CPU).

The stub's greedy token at position p is script[p + 1] whatever the input, so a workload is a script: `quote` repeats
one passage (the prompt holds it once and a half: every continuation is a quote, acceptance ~1), `chat` is fresh
tokens with a span quoted from earlier text every `CHAT_PERIOD` tokens (most drafts are rejected). Every request of
a batch follows the same script from its own point (request i's prompt is 5 i tokens longer: their quotes come at
different steps, as a batch's different requests' do). What is timed (process CPU time) is the engine's host work:
scheduling, step inputs, drafting, verification, rollback, detokenizing and outputs; on a GPU it comes on top of the
forward in a speculative step (the host waits for the verify step's tokens) and hides behind it in plain decoding
(overlapped steps). So the speed-up here bounds what host work allows; a model with negligible compute would reach it.
--step-costs h200: instead, a simulated clock advances by what a step of that kind and batch size took on the H200
(`H200_STEP_MS`); the speculation policy times steps with it too, so its decisions are those it would take there.
"""
import time
from math import log2

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
OFFSET = 5  # tokens: request i's prompt is OFFSET * i longer (mod CHAT_PERIOD) than request 0's
# ms per step on the H200, the embedded model's fp8 checkpoint, n-gram k = 8, by batch size (docs/performance.md,
# second wave part 3, dev/notes/h200_wave2c/spec_real2.jsonl): a plain (overlapped) decode step, the mean of the quote
# and chat runs' plain tok/s; a verify step, the quote runs without pausing (every step verifies 8.72 tokens per
# sequence). The verify cost did not grow with its tokens there (k = 4, 8, 16 and batch 4-16 alike, within the runs'
# spread), so a step of any multi-token shape (verify or prefill) costs the verify figure. Batch 64: the run
# with the auto-off lifted (dev/notes/h200_wave2d/spec_off_v1_1305.jsonl), plain the mean of quote and
# chat, verify the quote run without the policy.
H200_STEP_MS = {"plain": {1: 0.73, 4: 1.00, 16: 1.07, 64: 1.31}, "verify": {1: 3.09, 4: 3.43, 16: 3.34, 64: 17.7}}


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


class SimulatedDevice:
    """The runner's forward, timed on a simulated clock: each step advances it by H200_STEP_MS for its kind (all
    sequences one new token: plain; else verify) at its batch size (interpolated in log2 of the batch size)."""

    def __init__(self, runner):
        self.now = 0.0  # seconds
        self.forward = runner.run
        runner.run = self.run

    def run(self, batch, rows, pending=None):
        kind = "plain" if all(n == 1 for n in batch.num_new_tokens) else "verify"
        self.now += step_ms(kind, len(batch.seqs)) / 1e3
        return self.forward(batch, rows, pending)

    def clock(self) -> float:
        return self.now


def step_ms(kind: str, batch_size: int) -> float:
    table = H200_STEP_MS[kind]
    sizes = sorted(table)
    b = min(max(batch_size, sizes[0]), sizes[-1])
    hi = next(s for s in sizes if s >= b)
    lo = max(s for s in sizes if s <= b)
    if hi == lo:
        return table[lo]
    f = (log2(b) - log2(lo)) / (log2(hi) - log2(lo))
    return table[lo] + f * (table[hi] - table[lo])


def script(workload: str, passage: int, length: int) -> tuple[list[int], int]:
    """(the tokens, request 0's prompt length) of a workload."""
    gen = torch.Generator().manual_seed(0)
    fresh = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
    if workload == "quote":
        return (fresh[:passage] * (-(-length // passage)))[:length], passage + passage // 2
    tokens = fresh[:2 * passage]
    while len(tokens) < length:
        start = int(torch.randint(0, len(tokens) - CHAT_QUOTE, (1,), generator=gen))
        tokens += fresh[len(tokens):len(tokens) + CHAT_PERIOD - CHAT_QUOTE] + tokens[start:start + CHAT_QUOTE]
    return tokens[:length], 2 * passage


def engine_for(args, workload: str) -> tuple[Engine, list[list[int]], SimulatedDevice | None]:
    """The engine on the scripted stub, per request of the largest batch its prompt, and the simulated device
    (--step-costs) or None."""
    tokens, prompt_len = script(workload, args.passage, args.passage * 2 + CHAT_PERIOD + args.output_len + 64)
    most = max(args.tps_batch_sizes)
    ckpt = dummy_checkpoint("bf16", dict(TINY, vocab_size=VOCAB, max_position_embeddings=len(tokens)), device="cpu")
    config = EngineConfig(max_batch_size=most, num_kv_blocks=most * (len(tokens) // 16 + 2), device="cpu",
                          dtype="float32", speculative="ngram", num_draft_tokens=args.num_draft_tokens,
                          speculative_max_batch_size=most)
    engine = Engine(ckpt.path, config, ckpt=ckpt, tokenizer=DummyTokenizer())
    engine.runner.model = ScriptedModel(ckpt.config, tokens)
    device = SimulatedDevice(engine.runner) if args.step_costs else None
    return engine, [tokens[:prompt_len + OFFSET * i % CHAT_PERIOD] for i in range(most)], device


def timed_run(engine: Engine, prompts: list[list[int]], output_len: int, decoder, clock) -> tuple[float, list]:
    """(seconds on clock, outputs) of a streamed greedy request per prompt, output_len tokens each."""
    engine.spec = decoder
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    t0, done = clock(), {}
    for i, prompt in zip(ids, prompts):
        engine.add_request(i, prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return clock() - t0, [done[i] for i in ids]


def run(args, emit) -> bool:
    """Per workload and batch size: tokens/s plain, n-gram speculating at every step (pausing sequences whose drafts
    miss: the engine's way before the policy) and n-gram with the policy (the engine's way): its first run (cold: it
    learns) and then the least disturbed of --repeats runs with what it learnt (warm, as a serving engine's policy
    is after earlier requests)."""
    timing = "simulated H200 step costs" if args.step_costs else "process CPU time, model forward stubbed"
    print(f"host-only tokens/s ({timing}), greedy, {args.output_len} tokens each, "
          f"n-gram k={args.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS['ngram']}: best of {args.repeats}")
    print("| workload | batch | plain tok/s | n-gram, no policy | x | policy, cold | x | policy, warm | x | "
          "acceptance | tokens/step | verify steps (warm) | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for workload in ("quote", "chat"):
        engine, prompts, device = engine_for(args, workload)
        clock = device.clock if device else time.process_time
        timed_run(engine, prompts[:1], 16, None, clock)  # first-step costs outside the timing
        for b in args.tps_batch_sizes:
            tps, same, decoders = {}, True, {}
            for name, adaptive in (("plain", None), ("no_policy", False), ("spec", True)):
                times = []
                policy = decoder(engine, True, clock) if adaptive else None  # one policy, learning over the runs
                for _ in range(args.repeats + bool(adaptive)):
                    decoders[name] = policy or (None if adaptive is None else decoder(engine, False, clock))
                    if policy:
                        policy.recent.clear()  # its verify-step fraction: of this run's steps
                    seconds, out = timed_run(engine, prompts[:b], args.output_len, decoders[name], clock)
                    times.append(seconds)
                    reference = out if name == "plain" else reference
                    same &= out == reference
                if adaptive:
                    tps["cold"] = b * args.output_len / times.pop(0)
                tps[name] = b * args.output_len / min(times)  # the least disturbed run (a shared machine)
            s, p = decoders["no_policy"], decoders["spec"]
            rate = s.num_accepted / s.num_drafted if s.num_drafted else 0.0
            per_step = 1 + s.num_accepted / s.num_verified if s.num_verified else 1.0  # per sequence and step
            enabled = sum(p.recent) / len(p.recent) if p.recent else 0.0  # of the last run's decode steps
            x = {name: tps[name] / tps["plain"] for name in tps}
            emit({"bench": "spec-host", "workload": workload, "batch": b, "step_costs": args.step_costs or "cpu",
                  "num_draft_tokens": engine.config.num_draft_tokens, "output_len": args.output_len,
                  "plain_tok_s": tps["plain"], "no_policy_tok_s": tps["no_policy"], "cold_tok_s": tps["cold"],
                  "spec_tok_s": tps["spec"], "speedup": x["spec"], "cold_speedup": x["cold"],
                  "no_policy_speedup": x["no_policy"], "acceptance_rate": rate, "tokens_per_step": per_step,
                  "enabled_fraction": enabled, "identical_outputs": same})
            print(f"| {workload} | {b} | {tps['plain']:.0f} | {tps['no_policy']:.0f} | {x['no_policy']:.2f} | "
                  f"{tps['cold']:.0f} | {x['cold']:.2f} | {tps['spec']:.0f} | {x['spec']:.2f} | {rate:.2f} | "
                  f"{per_step:.2f} | {enabled:.2f} | {'yes' if same else 'NO'} |")
            ok &= same
    return ok


def decoder(engine: Engine, adaptive: bool, clock) -> SpecDecoder:
    return SpecDecoder(NgramDrafter(engine.config.ngram_size), engine.config, adaptive=adaptive, clock=clock)
