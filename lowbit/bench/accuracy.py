"""Accuracy of every recipe on the embedded model, beside modelopt's stock config for the same format.

For each recipe: quantize time (calibration + export), checkpoint size, held-out perplexity on BoolQ and LAMBADA
passages (never calibration text) vs the unquantized model. lowbit rows are measured through lowbit's reference
reader on the exported checkpoint; stock rows on modelopt's fake-quant model (stock INT4 group 128 cannot be
exported on 576-wide layers). Writes a markdown table (default docs/accuracy.md) after every row.

    lowbit bench accuracy                       # all recipes, 8 x 512 tokens per held-out source
    lowbit bench accuracy --recipes int4_awq,int4_rtn --num-seqs 4 --out /tmp/acc.md
"""
import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowbit import formats, models
from lowbit.calibrate.data import builtin_texts, token_batches
from lowbit.recipe import load_recipe

RECIPES = ("fp8", "fp8_dynamic", "nvfp4", "int4_rtn", "int4_awq", "w8a8_sq")
SOURCES = ("boolq", "lambada")
SEQ_LEN = 512
NOTES_MARK = "<!-- notes: kept across re-runs -->"


def heldout(tokenizer, num_seqs: int) -> list[tuple[str, list[int]]]:
    return [(s, ids) for s in SOURCES
            for ids in token_batches(tokenizer, builtin_texts(s, "heldout"), num_seqs, SEQ_LEN, seed=0)]


@torch.no_grad()
def perplexity(model, seqs) -> dict:
    """{source: exp(mean next-token nll)} over the held-out sequences."""
    nll = {s: [] for s in SOURCES}
    for source, ids in seqs:
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
        nll[source].append(-logp.gather(1, x[0, 1:, None]).mean())
    return {s: math.exp(torch.stack(v).mean()) for s, v in nll.items()}


def stock_config(recipe):
    import modelopt.torch.quantization as mtq

    from lowbit.calibrate.configs import stock_config as stock

    cfg = stock(recipe)
    kv = formats.kv_format(recipe.kv_cache)
    if kv is not None:
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, kv.stock)["quant_cfg"])
    return cfg


def measure(recipe, stock: bool, seqs, model_dir: Path) -> dict:
    from lowbit.calibrate.configs import stock_name
    from lowbit.calibrate.loop import calibrate
    from lowbit.checkpoint.reference import load_reference_model
    from lowbit.quantize.api import load_float_model
    from lowbit.quantize.export import export

    t0 = time.time()
    model, tok = load_float_model(model_dir)
    c = recipe.calibration
    batches = token_batches(tok, builtin_texts(c.data.removeprefix("builtin:"), "calib"), c.num_samples, c.seq_len, c.seed)
    calibrate(model, recipe, batches, config=stock_config(recipe) if stock else None)
    calib_s = time.time() - t0
    row = {"recipe": recipe.name, "config": f"modelopt {stock_name(recipe)}" if stock else "lowbit",
           "quant_algo": recipe.quant_algo, "calib_s": calib_s}
    if stock:
        row["ppl"] = perplexity(model, seqs)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt"
        t1 = time.time()
        try:
            export(model, tok, recipe, out, source=str(model_dir))
        except NotImplementedError as e:  # stock INT4 g128 on 576-wide layers: recorded in the table
            row["export_error"] = str(e).split(":")[0]
        else:
            row["export_s"] = time.time() - t1
            row["size_mb"] = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
            if not stock:
                row["ppl"] = perplexity(load_reference_model(out)[0], seqs)
    return row


def baseline(seqs, model_dir: Path) -> dict:
    from lowbit.quantize.api import load_float_model

    model, _ = load_float_model(model_dir)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    return {"recipe": "unquantized (fp32)", "config": "—", "quant_algo": "—", "size_mb": size,
            "ppl": perplexity(model, seqs)}


def markdown(rows: list[dict], meta: dict) -> str:
    base = rows[0]["ppl"]
    lines = [
        "# Accuracy of lowbit recipes vs modelopt stock configs (embedded SmolLM2-135M)", "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Date: {meta['date']}  ",
        f"Held-out text: {meta['heldout']}; calibration: each recipe's own `calibration` section (BoolQ calib split).", "",
        "Times are wall-clock on a 2-core machine shared with other engineers' jobs: they are noisy (x2 either way).",
        "lowbit rows: perplexity of lowbit's reference reader on the exported checkpoint. Stock rows: modelopt's",
        "fake-quant model (same calibration data; FP8 KV added with `update_quant_cfg_with_kv_cache_quant` where the",
        "recipe has a KV cache).", "",
        "| recipe | config | quant_algo | calibrate s | export s | size MB | BoolQ ppl | LAMBADA ppl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        calib = f"{r['calib_s']:.0f}" if "calib_s" in r else "—"
        export = f"{r['export_s']:.0f}" if "export_s" in r else ("fails" if "export_error" in r else "—")
        size = f"{r['size_mb']:.0f}" if "size_mb" in r else "—"
        ppl = [f"{r['ppl'][s]:.2f} ({100 * (r['ppl'][s] / base[s] - 1):+.1f} %)" for s in SOURCES]
        lines.append(f"| {r['recipe']} | {r['config']} | {r['quant_algo']} | {calib} | {export} | {size} | {ppl[0]} | "
                     f"{ppl[1]} |")
    return "\n".join(lines) + "\n\n" + NOTES_MARK + "\n" + meta.get("notes", "")


def kept_notes(out: Path) -> str:
    """Hand-written notes below NOTES_MARK in an existing output survive a re-run."""
    text = out.read_text() if out.is_file() else ""
    return text.split(NOTES_MARK + "\n", 1)[1] if NOTES_MARK in text else ""


def rows_from_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="lowbit bench accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--num-seqs", type=int, default=8, help="held-out sequences of 512 tokens per source")
    p.add_argument("--no-stock", action="store_true", help="skip modelopt's stock configs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/accuracy.md")
    p.add_argument("--from-log", help="re-render the table from the JSON rows of an earlier run's stderr log")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = models.resolve(models.DEFAULT_MODEL)
    from transformers import AutoTokenizer

    seqs = heldout(AutoTokenizer.from_pretrained(model_dir), args.num_seqs)
    meta = {"command": "lowbit bench accuracy " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
                       f"({args.threads} thread), {platform.platform()}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "heldout": f"{args.num_seqs} x {SEQ_LEN} tokens each of BoolQ and LAMBADA held-out passages",
            "notes": kept_notes(Path(args.out))}
    out = Path(args.out)
    if args.from_log:
        out.write_text(markdown(rows_from_log(Path(args.from_log)), meta))
        return 0
    rows = [baseline(seqs, model_dir)]
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for name in args.recipes.split(","):
        for stock in (False, True)[:1 if args.no_stock else 2]:
            rows.append(measure(load_recipe(name), stock, seqs, model_dir))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
