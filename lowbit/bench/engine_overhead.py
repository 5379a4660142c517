"""`lowbit bench engine-overhead`: the engine's host work per step, with the model's GPU work taken out (CPU only).

The engine runs a tiny dummy Llama (one layer, 128k vocabulary like Llama 3) whose forward is replaced by a stub:
zeros for the hidden states and fixed logits, so what is timed is everything the host does around the GPU step —
schedule (Scheduler.schedule), prepare (ModelRunner.run: inputs, step context, copies; the stub forward costs
nothing), sample (Sampler), and update+outputs (the rest of Engine.step: scheduler update, appending tokens,
detokenizing, stop checks, RequestOutputs). Requests arrive at once (batch = number of requests), greedy,
EOS ignored; figures are means over pure-decode steps (the CUDA-graph steps), their median, and the mean over
all steps.

The stub's logits have --sample-vocab columns (default 256): on a GPU the greedy argmax over the real 128k vocabulary
is a device kernel, and on this CPU it would cost 29 ms at batch 256 and hide the host work. Pass
--sample-vocab 128256 to include it. Detokenization uses a stub tokenizer like `lowbit bench serve`'s, but with one
character per token (with "" the detokenizer never advances its window and re-slices the whole completion every
token); --real-tokenizer uses the embedded model's tokenizer (49k vocabulary) to show its cost, and
--no-detok-metrics stubs the detokenizer and the latency histograms out. CPU time (--clock cpu) by default.

`lowbit bench engine-overhead [--batches 64,256,512] [--workloads 128/128,1000/1000] [--json PATH]`
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


from lowbit.serve.engine.config import EngineConfig
from lowbit.testing.dummy_weights import LLAMA_3_1_8B, dummy_checkpoint
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
PHASES = ("schedule", "prepare", "sample", "update+outputs")
TINY = dict(LLAMA_3_1_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, dtype="float32")


class DummyTokenizer:
    """One character per token, at no cost: the detokenizer's own work is timed, not a tokenizer's."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class StubModel:
    """The model without its work: hidden states [T, 1] of zeros; logits row r is a fixed row of a [B, V] table."""

    def __init__(self, config: dict, max_rows: int, sample_vocab: int):
        self.config = config
        self.logits = torch.randn(max_rows, sample_vocab, generator=torch.Generator().manual_seed(0))
        self.hidden = torch.zeros(1, 1)

    def __call__(self, input_ids, ctx):
        return self.hidden.expand(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        return self.logits[:hidden.shape[0]]


def build(args, batch: int, isl: int, osl: int) -> Engine:
    tokenizer, vocab = DummyTokenizer(), TINY["vocab_size"]
    if args.real_tokenizer:
        from transformers import AutoTokenizer

        from lowbit.models import DEFAULT_MODEL, resolve
        tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL))
    blocks = batch * -(-(isl + osl) // 16) + 16
    ckpt = dummy_checkpoint("bf16", dict(TINY, max_position_embeddings=isl + osl + 16), device="cpu")
    config = EngineConfig(max_batch_size=batch, max_num_tokens=args.max_num_tokens, num_kv_blocks=blocks,
                          device="cpu", dtype="float32")
    engine = Engine(ckpt.path, config, ckpt=ckpt, tokenizer=tokenizer)
    engine.runner.model = StubModel(dict(TINY, vocab_size=min(vocab, len(tokenizer)) if args.real_tokenizer else
                                         vocab), max(batch, args.max_num_tokens), args.sample_vocab)
    return engine


class Timer:
    """Wraps the engine's phases; records each step's split and whether it was pure decode."""

    def __init__(self, engine: Engine, clock):
        self.clock = clock
        self.now = defaultdict(float)
        self.steps: list[tuple[bool, dict]] = []
        self.decode = False
        schedule, run, sampler = engine.scheduler.schedule, engine.runner.run, engine.sampler

        def timed(name, fn):
            def call(*a, **k):
                t0 = self.clock()
                out = fn(*a, **k)
                self.now[name] += self.clock() - t0
                if name == "schedule" and out is not None:
                    self.decode = out.is_decode
                return out
            return call

        engine.scheduler.schedule = timed("schedule", schedule)
        engine.runner.run = timed("prepare", run)
        if engine.overlap:  # overlapped steps call the sampler's device half only
            sampler.sample = timed("sample", sampler.sample)
        else:
            engine.sampler = timed("sample", sampler)
        self.engine = engine

    def step(self) -> int:
        self.now.clear()
        t0 = self.clock()
        outs = self.engine.step()
        total = self.clock() - t0
        split = {k: self.now[k] for k in PHASES[:3]}
        split["update+outputs"] = total - sum(split.values())
        split["total"] = total
        self.steps.append((self.decode, split))
        return sum(len(o.delta_token_ids) for o in outs)


def measure(args, batch: int, isl: int, osl: int) -> dict:
    engine = build(args, batch, isl, osl)
    engine.overlap = args.overlap
    vocab = engine.runner.model.config["vocab_size"]
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, isl), generator=g).tolist()
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    timer = Timer(engine, CLOCKS[args.clock])
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, stream=not args.offline)
    tokens = 0
    while engine.has_unfinished():
        tokens += timer.step()
    wall = time.perf_counter() - t0
    assert tokens == batch * osl, (tokens, batch * osl)
    decode = [s for d, s in timer.steps if d]
    mean = {k: 1e3 * sum(s[k] for s in decode) / len(decode) for k in PHASES + ("total",)}
    totals = sorted(s["total"] for s in decode)
    return {"batch": batch, "isl": isl, "osl": osl, "clock": args.clock, "steps": len(timer.steps),
            "decode_steps": len(decode), "decode_ms": {k: round(v, 3) for k, v in mean.items()},
            "decode_ms_median": round(1e3 * totals[len(totals) // 2], 3),
            "all_steps_ms": round(1e3 * sum(s["total"] for _, s in timer.steps) / len(timer.steps), 3),
            "wall_s": round(wall, 2)}


def table(rows: list[dict]) -> str:
    head = "| ISL/OSL | batch | " + " | ".join(PHASES) + " | decode step | median | all steps |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        d = r["decode_ms"]
        lines.append(f"| {r['isl']}/{r['osl']} | {r['batch']} | " + " | ".join(f"{d[k]:.3f}" for k in PHASES) +
                     f" | {d['total']:.3f} | {r['decode_ms_median']:.3f} | {r['all_steps_ms']:.3f} |")
    return "\n".join(lines)


def stub_detokenizer_and_metrics() -> None:
    """For this process: no text (no stop strings) and no latency histograms."""
    from lowbit.serve.engine.detokenizer import Detokenizer
    from lowbit.serve.engine.metrics import Histogram

    Detokenizer.add = lambda self, token_id: False
    Detokenizer.take = lambda self, finished: ""
    Histogram.observe = lambda self, value: None


def positive_ints(text: str) -> list[int]:
    """"64,256" -> [64, 256]; anything else is a usage error (one line, exit 2)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def workloads(text: str) -> list[tuple[int, int]]:
    """"128/128,1000/1000" -> [(128, 128), (1000, 1000)]."""
    try:
        pairs = [tuple(positive_ints(w.replace("/", ","))) for w in text.split(",")]
    except argparse.ArgumentTypeError:
        pairs = []
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected ISL/OSL pairs such as 128/128,1000/1000, got {text!r}")
    return pairs


def parse(argv):
    p = argparse.ArgumentParser(prog="lowbit bench engine-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=positive_ints, default="64,256,512")
    p.add_argument("--workloads", type=workloads, default="128/128,1000/1000", help="ISL/OSL pairs")
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--sample-vocab", type=int, default=256, help="columns of the stub's logits (see above)")
    p.add_argument("--real-tokenizer", action="store_true")
    p.add_argument("--offline", action="store_true",
                   help="requests as LLM.generate adds them: one output each, text decoded once at the end")
    p.add_argument("--no-detok-metrics", action="store_true",
                   help="stub Detokenizer.add/take and Histogram.observe out, to see what they cost per step")
    p.add_argument("--overlap", action="store_true",
                   help="the engine's overlapped steps (the GPU default), run on this CPU: same work, other order")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: this process's CPU time (steady on a shared machine); wall: elapsed time")
    p.add_argument("--json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    if args.no_detok_metrics:
        stub_detokenizer_and_metrics()
    rows = []
    for isl, osl in args.workloads:
        for batch in args.batches:
            rows.append(measure(args, batch, isl, osl))
            print(f"{isl}/{osl} batch {batch}: decode step {rows[-1]['decode_ms']['total']:.3f} ms "
                  f"({rows[-1]['wall_s']} s)", file=sys.stderr, flush=True)
    print(f"ms per step ({args.clock} clock), host only (model forward stubbed): phases and 'decode step' are means"
          " over pure-decode steps, 'median' their median, 'all steps' the mean over every step (prefills too)")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
