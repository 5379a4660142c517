"""Greedy decode of a checkpoint, scored by the reference reader teacher-forced: the engine's vs the reader's own.

Each greedy token should be the reader's argmax at its position; static activation rounding (FP8, INT8, NVFP4) makes
the model itself shape-sensitive, so the reader's own one-token-a-step decode (HF generate) is the bar to compare with.

    PYTHONPATH=$PWD python3 dev/bench/decode_agreement.py CHECKPOINT [--prompts 8] [--new-tokens 24] [--device cpu]
"""
import argparse
import sys

import torch

import lowbit
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.checkpoint.reference import load_reference_model

NEAR_TIE = 0.3  # nats below the reader's argmax that still counts as a near tie


def score(model, prompts: list[list[int]], seqs: list[list[int]]) -> tuple[int, int, int]:
    """(tokens equal to the reader's argmax, tokens more than NEAR_TIE below it, tokens scored)."""
    exact = far = total = 0
    for ids, seq in zip(prompts, seqs):
        with torch.no_grad():
            lp = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)  # [len(seq), vocab]
        for pos in range(len(ids) - 1, len(seq) - 1):
            best, chosen = lp[pos].max().item(), lp[pos, seq[pos + 1]].item()
            exact += chosen == best
            far += chosen < best - NEAR_TIE
            total += 1
    return exact, far, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", type=int, default=8, help="held-out LAMBADA prompts of 48 tokens")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--device", default="cpu", help="the engine's device (the reader runs on CPU)")
    a = p.parse_args(argv)
    model, tok = load_reference_model(a.checkpoint)
    prompts = token_batches(tok, builtin_texts("lambada", "heldout"), a.prompts, 48, seed=1)
    with torch.no_grad():
        own = [model.generate(torch.tensor([ids]), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                              do_sample=False)[0].tolist() for ids in prompts]
    llm = lowbit.LLM(a.checkpoint, device=a.device, num_kv_blocks=64)
    outs = llm.generate(prompts, lowbit.SamplingParams(max_tokens=a.new_tokens, temperature=0, ignore_eos=True))
    served = [ids + list(o.outputs[0].token_ids) for ids, o in zip(prompts, outs)]
    for name, seqs in (("reader decode", own), (f"engine decode ({a.device})", served)):
        exact, far, total = score(model, prompts, seqs)
        print(f"{name}: reader's argmax at {exact}/{total} tokens, more than {NEAR_TIE} nats below it at {far}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
