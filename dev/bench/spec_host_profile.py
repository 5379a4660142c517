"""Profiles the host work of speculative steps on CPU: a stub forward whose greedy token is scripted by position
(quote-heavy: the continuation repeats the prompt's passage), so acceptance is 1 and compute is nil.
python3 dev/bench/spec_host_profile.py [--k 4] [--profile] [--batch 1]"""
import argparse
import cProfile
import pstats
import time

import torch

from lowbit.bench.engine_overhead import TINY, DummyTokenizer
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.testing.dummy_weights import dummy_checkpoint

V = 512


class ScriptStub:
    def __init__(self, config, script):
        self.config = config
        self.table = torch.full((len(script), V), -10.0)
        self.table[torch.arange(len(script) - 1), torch.tensor(script[1:])] = 10.0

    def __call__(self, input_ids, ctx):
        return ctx.positions.view(-1, 1)  # the hidden state is the position

    def compute_logits(self, hidden):
        return self.table[hidden[:, 0]]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", type=int, default=512)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    passage = torch.randint(1, V, (200,), generator=g).tolist()
    script = passage * 40
    prompt = script[:300]
    ckpt = dummy_checkpoint("bf16", dict(TINY, vocab_size=V, max_position_embeddings=4096), device="cpu")
    cfg = EngineConfig(max_batch_size=8, num_kv_blocks=1024, device="cpu", dtype="float32",
                       speculative=None if a.plain else "ngram", num_draft_tokens=a.k)
    engine = Engine(ckpt.path, cfg, ckpt=ckpt, tokenizer=DummyTokenizer())
    engine.runner.model = ScriptStub(ckpt.config, script)
    params = SamplingParams(max_tokens=a.out, temperature=0, ignore_eos=True)

    def run(tag):
        for i in range(a.batch):
            engine.add_request(f"{tag}{i}", prompt, params, stream=True)
        toks = 0
        while engine.has_unfinished():
            for o in engine.step():
                toks += len(o.delta_token_ids)
        return toks
    run("w")
    t0 = time.perf_counter()
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
    toks = run("r")
    dt = time.perf_counter() - t0
    if a.profile:
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
    s = engine.spec
    print(f"{'plain' if a.plain else 'ngram k=%d' % a.k} batch {a.batch}: {toks} tokens {dt*1e3:.1f} ms, "
          f"{toks/dt:.0f} tok/s" + (f", steps {s.num_steps} acc {s.num_accepted}/{s.num_drafted}" if s else ""))


if __name__ == "__main__":
    main()
