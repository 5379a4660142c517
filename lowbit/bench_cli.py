"""`lowbit bench NAME [ARGS...]`: runs lowbit.bench.NAME's main(ARGS).

Benchmarks print their figures (and write JSON with --json); they are never timed unit tests.
"""
import importlib
import json
from pathlib import Path

BENCHES = {
    "kernels": "kernels",  # low-precision GEMMs vs cuBLAS bf16 and torch._scaled_mm (GPU)
    "accuracy": "accuracy",  # every recipe on the embedded model: time, size, held-out perplexity (CPU)
    "serve": "serve_bench",  # engine throughput and latency on dummy Llama-3.1-8B weights vs HF generate (GPU)
    "serve-prefix": "serve_prefix",  # TTFT of a long prefix evicted from the device: recomputed vs host cache (GPU)
    "serve-tp": "serve_tp",  # batch-1 ITL and maximum-load throughput per GPU at each tensor-parallel size
    "serve-load": "serve_load",  # concurrent streaming clients against `lowbit serve` (loopback)
    "engine-overhead": "engine_overhead",  # the engine's host work per step, model forward stubbed (CPU)
    "spec": "spec",  # speculative decoding: verify-step cost for k = 1..8, n-gram tok/s by batch (GPU; --tiny on CPU)
    "cpu": "cpu",  # the CPU engine vs transformers generate and HFLM-style scoring, same model and threads (CPU)
    "eval-speed": "eval_speed",  # `lowbit eval`'s candidate pass: one process vs worker processes, same scores (CPU)
}


def add_arguments(parser) -> None:
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    parser.add_argument("args", nargs="...", help="arguments for the benchmark (see `lowbit bench NAME --help`)")


def run(args) -> int:
    return load(args.name).main(args.args) or 0


def load(name: str):
    """The module of benchmark `name` (a key of BENCHES)."""
    return importlib.import_module(f"lowbit.bench.{BENCHES[name]}")


def json_lines(path: Path | None = None):
    """(emit, lines) for a benchmark's records: emit(d) rounds d's floats (2 decimals from 1 up, else 3 significant
    digits), keeps it in lines, prints it as one JSON line and, with a path, appends it there as it goes (the file
    is emptied first), so a run cut short keeps what it measured."""
    lines = []
    if path is not None:
        Path(path).write_text("")

    def emit(d: dict) -> None:
        d = {k: (round(v, 2) if abs(v) >= 1 else float(f"{v:.3g}")) if isinstance(v, float) else v
             for k, v in d.items()}
        lines.append(d)
        print(json.dumps(d), flush=True)
        if path is not None:
            with Path(path).open("a") as f:
                f.write(json.dumps(d) + "\n")

    return emit, lines


def int_list(parser, flag: str, text: str) -> list[int]:
    """'1,16,64' -> [1, 16, 64] of positive ints (for a benchmark's flag); anything else is a usage error (one line,
    exit 2)."""
    return [t[0] for t in _int_tuples(parser, flag, text, 1, "N[,N...]")]


def int_pairs(parser, flag: str, text: str) -> list[tuple[int, int]]:
    """'AxB,CxD' -> [(A, B), (C, D)] of positive ints; anything else is a usage error (one line, exit 2)."""
    return _int_tuples(parser, flag, text, 2, "AxB[,CxD...]")


def gemv_configs(parser, flag: str, text: str) -> list[tuple[int, int, int]]:
    """'BN,BK,W;BN,BK,W' -> [(BN, BK, W), ...] of positive ints (a GEMV bench's tile configs); anything else is a
    usage error (one line, exit 2)."""
    return _int_tuples(parser, flag, text, 3, "BN,BK,W[;BN,BK,W...]", items=";", fields=",")


def _int_tuples(parser, flag: str, text: str, width: int, form: str, items: str = ",",
                fields: str = "x") -> list[tuple[int, ...]]:
    try:
        out = [tuple(int(v) for v in item.split(fields)) for item in text.split(items) if item.strip()]
    except ValueError:
        out = None
    if out is None or any(len(t) != width or min(t) <= 0 for t in out):
        parser.error(f"{flag} {text!r}: expected {form} with positive integers")
    return out
