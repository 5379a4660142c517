"""`lowbit bench serve --phases interop`: batch-1 decode of the same dummy int4 weights in modelopt, compressed-tensors
pack-quantized, GPTQ and AutoAWQ GEMM layouts, each repacked at load by lowbit's readers, side by side.

Per layout: the engine's linear kinds, greedy tokens of one prompt against modelopt's, and batch-1 decode tok/s (the
median of three runs, each from its median inter-token latency); a layout passes when its tokens equal modelopt's and
its tok/s is within 5 % of modelopt's (the repack at load, not a slower kernel).
"""
import torch

from lowbit.testing.dummy_layouts import LAYOUTS

SPEED_RATIO = 0.95  # a layout's batch-1 decode tok/s over modelopt's, at least
RUNS = 3


def linear_kinds(engine) -> dict:
    """{prepared kind: number of linears} of the engine's model ("w4" for the int4 kernels)."""
    kinds = {}
    for m in engine.runner.model.modules():
        p = getattr(m, "prepared", None)
        if p is not None:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
    return kinds


def build(args, layout: str):
    from lowbit.bench.serve_bench import DummyTokenizer, model_config
    from lowbit.serve.engine.config import EngineConfig
    from lowbit.serve.engine.engine import Engine
    from lowbit.testing.dummy_weights import dummy_checkpoint

    ckpt = dummy_checkpoint("int4_awq", model_config(args), device=args.device, layout=layout)
    cfg = EngineConfig(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, device=args.device,
                       dtype="float32" if args.tiny else "bfloat16")
    with torch.device(args.device):
        return Engine(ckpt.path, cfg, ckpt=ckpt, tokenizer=DummyTokenizer())


def measure(args, layout: str, prompt: list) -> dict:
    from lowbit.bench.serve_bench import free, greedy, latency

    engine = build(args, layout)
    try:
        res = {"layout": layout, "kinds": linear_kinds(engine), "tokens": greedy(engine, [prompt], args.osl)[0]}
        latency(engine, prompt, 4)  # warm: compiles the decode kernels and captures the graphs
        runs = sorted(latency(engine, prompt, args.osl)["decode_tok_s"] for _ in range(RUNS))
        res["decode_tok_s"], res["runs"] = runs[RUNS // 2], runs
    finally:
        del engine
        free()
    return res


def interop(args) -> dict:
    """Every layout in turn; the ratios and the pass decision against modelopt's row."""
    from lowbit.bench.serve_bench import model_config, random_prompts

    prompt = random_prompts(1, args.isl, model_config(args)["vocab_size"], 2)[0]
    rows = [measure(args, layout, prompt) for layout in LAYOUTS]
    base = rows[0]
    for r in rows:
        r["ratio"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
        r["same_tokens"] = r["tokens"] == base["tokens"]
        r["pass"] = r["same_tokens"] and r["ratio"] >= SPEED_RATIO
    return {"isl": args.isl, "osl": args.osl, "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
            "pass": all(r["pass"] for r in rows)}


def markdown(res: dict) -> list[str]:
    lines = [f"| int4 layout (repacked at load) | linear kinds | greedy == modelopt | batch-1 decode tok/s "
             f"(ISL {res['isl']}, OSL {res['osl']}) | / modelopt | pass (>= {SPEED_RATIO}) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['kinds']} | {r['same_tokens']} | {r['decode_tok_s']} | {r['ratio']} | "
              f"{r['pass']} |" for r in res["rows"]]
    return lines + [""]


__all__ = ["interop", "markdown", "SPEED_RATIO"]
