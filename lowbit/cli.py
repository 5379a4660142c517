"""One entry point: `lowbit quantize | eval | serve | bench | models`, plus the `quantize` script.

Each subcommand lives in its own module with `add_arguments(parser)` and `run(args) -> exit code`;
modules are imported only when their subcommand runs, so `lowbit models` never imports modelopt.
"""
import argparse
import importlib
import sys
import traceback

from lowbit.errors import UserError

# Exit codes every subcommand shares (a command may add its own below 2, as `eval` does with 1 = gate failed).
EXIT_USAGE = 2  # bad input: one line on stderr
EXIT_INTERNAL = 3  # a failure inside lowbit: its traceback, then one line

SUBCOMMANDS = {
    "quantize": ("lowbit.quantize.cli", "calibrate a model with a recipe and write a quantized checkpoint"),
    "eval": ("lowbit.evaluate.cli", "measure a checkpoint against its baseline and gate it"),
    "serve": ("lowbit.serve.server.cli", "serve a checkpoint by name with an OpenAI-compatible API"),
    "bench": ("lowbit.bench_cli", "benchmarks: kernels, serving throughput and latency"),
    "models": ("lowbit.models_cli", "list the models and checkpoints in the store"),
    "convert": ("lowbit.convert_cli", "rewrite a quantized checkpoint as modelopt or compressed-tensors"),
}


def _module(name: str):
    return importlib.import_module(SUBCOMMANDS[name][0])


def build_parser(only: str | None = None, argv=None) -> argparse.ArgumentParser:
    if only:
        mod = _module(only)
        parser = argparse.ArgumentParser(prog=only, description=SUBCOMMANDS[only][1], epilog=getattr(mod, "EXAMPLES", None),
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(parser)
        parser.set_defaults(command=only)
        return parser
    parser = argparse.ArgumentParser(prog="lowbit", description="Quantize, gate and serve LLMs on low-precision kernels.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        if name not in (sys.argv[1:] if argv is None else argv)[:1]:  # import only the module that runs
            sub.add_parser(name, help=help_text)
            continue
        mod = _module(name)
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=getattr(mod, "EXAMPLES", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
    return parser


def _run(parser: argparse.ArgumentParser, argv) -> int:
    args = parser.parse_args(argv)
    try:
        return _module(args.command).run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- reported in full, with a code a CI job can tell from "gate failed"
        traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {e} (exit {EXIT_INTERNAL})", file=sys.stderr)
        return EXIT_INTERNAL


def main(argv=None) -> int:
    return _run(build_parser(argv=argv), argv)


def quantize_main(argv=None) -> int:
    return _run(build_parser(only="quantize"), argv)


if __name__ == "__main__":
    sys.exit(main())
