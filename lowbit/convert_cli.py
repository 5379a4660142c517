"""`lowbit convert SRC DST --to modelopt|compressed-tensors`: a quantized checkpoint rewritten in the other layout."""
import json
import shutil
import time
from pathlib import Path

from lowbit import __version__
from lowbit.errors import UserError
from lowbit.progress import Progress, stage

TARGETS = ("modelopt", "compressed-tensors")
EXAMPLES = """examples:
  lowbit convert ./llama8b-awq ./llama8b-awq-ct --to compressed-tensors   # for vLLM
  lowbit convert ./Llama-3.1-8B-Instruct-FP8 ./llama8b-fp8 --to modelopt     # llm-compressor's FP8 -> modelopt"""
# files of a source checkpoint that the conversion rewrites (the rest, e.g. the tokenizer, is copied)
REWRITTEN = ("config.json", "hf_quant_config.json", "lowbit_manifest.json", "model.safetensors.index.json")


def add_arguments(parser) -> None:
    parser.add_argument("src", help="checkpoint: store name or directory (modelopt, compressed-tensors, AutoAWQ, GPTQ)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--to", required=True, choices=TARGETS, help="layout to write")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args) -> int:
    from lowbit import models

    convert(models.resolve(args.src), Path(args.dst), args.to, force=args.force)
    print(f"[lowbit] converted {args.src} -> {args.dst} ({args.to})")
    return 0


def convert(src: Path, dst: Path, to: str, force: bool = False) -> Path:
    """Reads `src` (any layout lowbit reads) and writes it to `dst` in layout `to`, atomically."""
    from lowbit.checkpoint.io import read, write_atomically, write_manifest

    if to not in TARGETS:
        raise UserError(f"--to {to!r} is not one of {', '.join(TARGETS)}")
    ckpt = read(src)
    if ckpt.quant is None:
        raise UserError(f"{src}: an unquantized checkpoint has nothing to convert")
    with write_atomically(dst, force=force) as tmp:
        for f in Path(src).iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in REWRITTEN:
                shutil.copy2(f, tmp / f.name)
        if to == "compressed-tensors":
            _to_compressed_tensors(ckpt, tmp)
        else:
            _to_modelopt(ckpt, tmp)
        write_manifest(tmp, {"producer": f"lowbit {__version__} convert", "source_model": str(src),
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return dst


def _to_compressed_tensors(ckpt, out: Path) -> None:
    from lowbit.checkpoint.interop.export_compressed_tensors import convert, quantized_modules, save

    with stage(f"reading {ckpt.path}"):
        tensors = ckpt.tensors()
    with Progress(len(quantized_modules(tensors)), "converting to compressed-tensors", "linears") as bar:
        qc, tensors = convert(ckpt, tensors, on_module=bar.update)
    with stage(f"writing {len(tensors)} tensors"):
        save(out, ckpt.config, qc, tensors)


def _to_modelopt(ckpt, out: Path) -> None:
    """hf_quant_config.json (the per-layer quantization dict) + lowbit's tensors as they are."""
    from safetensors.torch import save_file

    with stage(f"reading {ckpt.path}"):
        tensors = ckpt.tensors()
    for m in sorted(k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")):
        fmt = ckpt.layer_format(m)
        if fmt is None or fmt.calibration is None:
            raise UserError(f"{ckpt.path}: {m} is {fmt.name if fmt else 'unlisted'}, which has no modelopt "
                            "quant_algo (e.g. zero points, dynamic int8 activations)")
    quant = {k: v for k, v in ckpt.quant.items() if k != "source"}
    with stage(f"writing {len(tensors)} tensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    producer = {"name": "lowbit", "version": __version__}
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quant}, indent=2))
