"""Drafting policies replayed on real greedy text: the embedded model's plain greedy outputs for `lowbit bench spec`'s
quote and chat prompts (CPU), then each policy's drafts scored against them offline (greedy output does not depend
on the drafts, so the replay is exact). A verify step costs r plain decode steps (r = 3: the H200 run of
docs/performance.md, 2.08 ms per verify step against 0.69 ms per decode step; r = 1.4: CPU host-only).
PYTHONPATH=. python3 dev/bench/spec_policy_sim.py [--output-len 192]"""
import argparse
import json
from pathlib import Path

from lowbit.bench.spec import CHAT, PASSAGE
from lowbit.serve.spec.ngram import NgramIndex


def outputs(n_out: int, cache: Path) -> dict:
    if cache.exists():
        return json.loads(cache.read_text())
    from lowbit.serve.llm import LLM
    from lowbit.serve.engine.sampling_params import SamplingParams
    llm = LLM("smollm2-135m", num_kv_blocks=512, max_batch_size=8)
    quote = [f"Request {i}. Passage: {PASSAGE}\nRepeat the passage word for word.\nPassage: {PASSAGE}\n"
             f"Again, word for word:\n" for i in range(4)]
    chat = [f"User: {c} (request {i})\nAssistant:" for i, c in enumerate(CHAT)]
    out = {}
    for name, texts in (("quote", quote), ("chat", chat)):
        ids = [llm.engine.tokenizer.encode(t) for t in texts]
        res = llm.generate(ids,
                           SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))
        out[name] = [p + list(r.outputs[0].token_ids) for p, r in zip(ids, res)], [len(p) for p in ids]
    cache.write_text(json.dumps(out))
    return out


def replay(tokens, start, k_max, adaptive, min_n, r):
    """(tokens per cost unit / plain, acceptance) of one sequence under a policy."""
    index, t, k, pause_until, pause, cost, drafted, accepted = NgramIndex(3), start + 1, k_max, 0, 0, 0.0, 0, 0
    while t < len(tokens):
        d = []
        if t >= pause_until:
            d = propose(index, tokens[:t], k, min_n)
        a = 0
        while a < len(d) and t + a < len(tokens) and d[a] == tokens[t + a]:
            a += 1
        cost += r if d else 1
        drafted, accepted = drafted + len(d), accepted + a
        if d and adaptive:
            if adaptive != "pause":
                k = min(k_max, 2 * k) if a == len(d) else a + 1
            if a == 0 and adaptive != "shrink":
                pause = min(16, 2 * pause or 1)
                pause_until = t + 1 + pause
            else:
                pause = 0
        t += a + 1
    return (len(tokens) - start - 1) / cost, accepted / max(drafted, 1)


def propose(index, ids, k, min_n):
    d = index.propose(ids, k)
    if not d or min_n == 1:
        return d
    return d if any(index.last.get(tuple(ids[len(ids) - m:])) is not None for m in range(min_n, index.n + 1)) else []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-len", type=int, default=192)
    a = p.parse_args()
    data = outputs(a.output_len, Path(f"/tmp/spec_sim_{a.output_len}.json"))
    print("| workload | r | policy | speed-up | acceptance |")
    for name, (seqs, starts) in data.items():
        for r in (3.0, 1.4):
            for k, adaptive, min_n in [(4, False, 1), (8, False, 1), (8, True, 1), (8, False, 2), (8, True, 2),
                                       (8, "pause", 2), (8, "shrink", 2), (4, False, 2), (16, False, 2),
                                       (16, "pause", 2)]:
                res = [replay(s, st, k, adaptive, min_n, r) for s, st in zip(seqs, starts)]
                sp = sum(x for x, _ in res) / len(res)
                acc = sum(y for _, y in res) / len(res)
                print(f"| {name} | {r} | k={k} {adaptive if isinstance(adaptive, str) else 'adaptive' if adaptive else 'fixed'} min_n={min_n} | {sp:.2f} | "
                      f"{acc:.2f} |")


if __name__ == "__main__":
    main()
