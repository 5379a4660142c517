"""Held-out perplexity of real checkpoints through the serving engine (prompt logprobs) and, on the CPU, through
the transformers reference reader: the check that the GPU path computes what the checkpoint prescribes.

    python3 dev/scripts/serving_ppl.py tokens OUT.json                # CPU: held-out BoolQ passages -> token ids
    python3 dev/scripts/serving_ppl.py ppl TOKENS.json CKPT... [--device cuda] [--dtype bfloat16] [--reference]
"""
import argparse
import json
import math
import sys
import time


def make_tokens(out, n_docs=24, max_len=512):
    from transformers import AutoTokenizer
    from lowbit.calibrate.data import builtin_texts
    from lowbit.models import resolve
    tok = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    docs = [tok.encode(t)[:max_len] for t in builtin_texts("boolq", "heldout")[:n_docs]]
    json.dump(docs, open(out, "w"))
    print(f"{len(docs)} docs, {sum(len(d) - 1 for d in docs)} scored tokens -> {out}")


def engine_ppl(path, docs, device, dtype):
    from lowbit.serve import LLM, SamplingParams
    llm = LLM(path, device=device, dtype=dtype, num_kv_blocks=512, max_num_tokens=512)
    outs = llm.generate(docs, SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll, n = 0.0, 0
    for doc, out in zip(docs, outs):
        for chosen, _top in out.prompt_logprobs[1:]:  # entry i: (logprob of prompt token i, top-N)
            nll -= chosen
            n += 1
    greedy = llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    return math.exp(nll / n), n, greedy


def reference_ppl(path, docs):
    import torch
    from lowbit.checkpoint.reference import load_reference_model
    model, _ = load_reference_model(path)
    nll, n = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([doc])
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            nll -= lp.gather(-1, ids[0, 1:, None]).sum().item()
            n += len(doc) - 1
    return math.exp(nll / n), n


def main(argv):
    if argv[0] == "tokens":
        return make_tokens(argv[1])
    p = argparse.ArgumentParser()
    p.add_argument("tokens")
    p.add_argument("ckpts", nargs="+")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reference", action="store_true", help="also the transformers reference reader (CPU)")
    p.add_argument("--torch-path", action="store_true", help="engine on its torch reference ops, even on CUDA")
    a = p.parse_args(argv[1:])
    if a.torch_path:
        import lowbit.kernels._triton as t
        t.HAS_TRITON = False
    docs = json.load(open(a.tokens))
    for path in a.ckpts:
        t0 = time.time()
        ppl, n, greedy = engine_ppl(path, docs, a.device, a.dtype)
        rec = {"ckpt": path.rstrip("/").split("/")[-1], "device": a.device, "dtype": a.dtype,
               "torch_path": a.torch_path, "engine_ppl": round(ppl, 3), "tokens": n, "greedy": greedy}
        if a.reference:
            rec["reference_ppl"] = round(reference_ppl(path, docs)[0], 3)
        rec["s"] = round(time.time() - t0, 1)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
