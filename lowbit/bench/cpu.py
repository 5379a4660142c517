"""`lowbit bench cpu`: the CPU engine side by side with transformers on the same model, inputs and thread count.

Per model (a store name or a checkpoint directory; default the embedded smollm2-135m), in one process:
  decode   batch 1, greedy, --new-tokens new tokens (EOS ignored) after one prompt: lowbit's `Engine` on the CPU vs
           transformers' `generate` (use_cache, greedy). tok/s = new tokens / wall time of the request (prefill
           included). Also reported: how many of the greedy tokens are the same.
  score    prompt logprobs of --docs held-out BoolQ passages of --doc-tokens tokens each (lm-eval's loglikelihood:
           echo + logprobs): lowbit: one request per document, max_tokens=0, prompt_logprobs=1, all queued at
           once; transformers: HFLM-style, per document one forward, log_softmax, the next tokens' logprobs and the
           greedy check (argmax). tokens/s = scored tokens / wall time. Also reported: the largest |difference|
           between the two sides' logprobs.
transformers runs `lowbit.checkpoint.load_reference_model` of the same checkpoint: the plain HF model when it is
unquantized; dequantized fp32 weights with fake-quantized activations (and KV) when quantized, the reference the
CPU engine is checked against. Both sides run in fp32 with --threads torch threads (default 1); prefix caching is
off so that repeats recompute their prompts. The two sides alternate --repeats times; each figure is the best run
(the machine is shared: the best run is the least disturbed), after one untimed warm-up run each.

`lowbit bench cpu [MODEL ...] [--threads 1] [--new-tokens 128] [--docs 8] [--doc-tokens 256] [--repeats 3]
[--json PATH]`
"""
import argparse
import time

import torch

PROMPT = "The history of the Roman Empire begins with"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="lowbit bench cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=["smollm2-135m"], help="store names or checkpoint directories")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both sides (default 1)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to decode (default 128)")
    p.add_argument("--docs", type=int, default=8, help="held-out documents to score (default 8)")
    p.add_argument("--doc-tokens", type=int, default=256, help="tokens per scored document (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per side; the best counts (default 3)")
    p.add_argument("--json", default=None, help="also append the records to this file as JSON lines")
    args = p.parse_args(argv)
    for flag in ("threads", "new_tokens", "docs", "doc_tokens", "repeats"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")

    from lowbit.bench_cli import json_lines

    torch.set_num_threads(args.threads)
    emit, lines = json_lines(args.json)
    for name in args.models:
        for record in bench_model(name, args):
            emit(record)
    print()
    print(table(lines, args))
    return 0


def bench_model(name: str, args) -> list[dict]:
    """Both benchmarks on one model: two records (decode, score) with the lowbit and transformers figures."""
    from lowbit import models
    from lowbit.calibrate.data import builtin_texts, token_batches
    from lowbit.checkpoint import load_reference_model
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine

    path = models.resolve(name)
    hf, tokenizer = load_reference_model(path)
    engine = Engine(path, EngineConfig(device="cpu", dtype="float32", enable_prefix_caching=False,
                                       max_batch_size=max(args.docs, 1)))
    prompt = tokenizer(PROMPT).input_ids
    docs = token_batches(tokenizer, builtin_texts("boolq", "heldout"), args.docs, args.doc_tokens, seed=0)
    lowbit_decode(engine, prompt, 4), hf_decode(hf, prompt, 4)  # warm-up: first-call allocations, lazy imports
    lowbit_score(engine, docs[:1]), hf_score(hf, docs[:1])
    dec = {"lowbit": [], "hf": []}
    sco = {"lowbit": [], "hf": []}
    for _ in range(args.repeats):
        dec["lowbit"].append(lowbit_decode(engine, prompt, args.new_tokens))
        dec["hf"].append(hf_decode(hf, prompt, args.new_tokens))
        sco["lowbit"].append(lowbit_score(engine, docs))
        sco["hf"].append(hf_score(hf, docs))
    (lb_s, lb_tokens), (hf_s, hf_tokens) = min(dec["lowbit"]), min(dec["hf"])
    (lb_ss, lb_lp), (hf_ss, hf_lp) = min(sco["lowbit"]), min(sco["hf"])
    scored = sum(len(d) - 1 for d in docs)
    same = sum(a == b for a, b in zip(lb_tokens, hf_tokens))
    diff = max(abs(a - b) for x, y in zip(lb_lp, hf_lp) for a, b in zip(x, y))
    common = {"model": name, "threads": args.threads}
    return [dict(common, bench="decode", new_tokens=args.new_tokens, lowbit_tok_s=args.new_tokens / lb_s,
                 hf_tok_s=args.new_tokens / hf_s, same_greedy_tokens=f"{same}/{args.new_tokens}"),
            dict(common, bench="score", docs=len(docs), scored_tokens=scored, lowbit_tok_s=scored / lb_ss,
                 hf_tok_s=scored / hf_ss, max_abs_logprob_diff=diff)]


def lowbit_decode(engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """(seconds, greedy token ids) of one batch-1 request through Engine.step."""
    from lowbit.serve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("decode", prompt, params, stream=False)
    outs = _drain(engine)
    return time.perf_counter() - start, outs["decode"].outputs[0].token_ids


@torch.inference_mode()
def hf_decode(model, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


def lowbit_score(engine, docs: list[list[int]]) -> tuple[float, list[list[float]]]:
    """(seconds, per document the logprobs of its tokens 1..n-1): all documents queued, then stepped to the end."""
    from lowbit.serve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    start = time.perf_counter()
    for i, doc in enumerate(docs):
        engine.add_request(f"score-{i}", doc, params, stream=False)
    outs = _drain(engine)
    elapsed = time.perf_counter() - start
    return elapsed, [[lp for lp, _ in outs[f"score-{i}"].prompt_logprobs[1:]] for i in range(len(docs))]


@torch.inference_mode()
def hf_score(model, docs: list[list[int]]) -> tuple[float, list[list[float]]]:
    """HFLM's loglikelihood per document (batch 1): logits, log_softmax, the continuation's logprobs, greedy check."""
    start = time.perf_counter()
    out = []
    for doc in docs:
        x = torch.tensor([doc])
        logprobs = model(x).logits[0, :-1].float().log_softmax(-1)
        target = x[0, 1:]
        chosen = logprobs.gather(1, target[:, None])[:, 0]
        bool((logprobs.argmax(-1) == target).all())  # HFLM's is_greedy
        out.append(chosen.tolist())
    return time.perf_counter() - start, out


def _drain(engine) -> dict:
    """Steps the engine until it is idle; the final RequestOutput of each request by id."""
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def table(lines: list[dict], args) -> str:
    """The records as a markdown table: one row per (model, benchmark), lowbit and transformers side by side."""
    rows = ["| model | benchmark | lowbit CPU engine | transformers | lowbit / HF | agreement |",
            "|---|---|---|---|---|---|"]
    for r in lines:
        if r["bench"] == "decode":
            what = f"decode tok/s (batch 1, greedy, {r['new_tokens']} new)"
            agree = f"{r['same_greedy_tokens']} greedy tokens equal"
        else:
            what = f"score tok/s ({r['docs']} docs, {r['scored_tokens']} tokens)"
            agree = f"max abs logprob diff {r['max_abs_logprob_diff']:.2g}"
        rows.append(f"| {r['model']} | {what} | {r['lowbit_tok_s']:.1f} | {r['hf_tok_s']:.1f} | "
                    f"{r['lowbit_tok_s'] / r['hf_tok_s']:.2f}x | {agree} |")
    rows.append(f"\n{args.threads} torch thread(s), best of {args.repeats} alternating runs, fp32.")
    return "\n".join(rows)
