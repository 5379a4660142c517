"""`lowbit models`: the store's entries with path, size and quantization."""
from lowbit import models


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    entries = models.list_models()
    if args.json:
        import json

        print(json.dumps(entries, indent=2))
        return 0
    print(f"store: {models.store_dir()}")
    if not entries:
        print(f"(empty; `lowbit quantize --recipe fp8` converts the default model {models.DEFAULT_MODEL} and quantizes it)")
        return 0
    width = max(len(e["name"]) for e in entries)
    print(f"{'NAME':<{width}}  {'SIZE':>9}  {'QUANTIZATION':<20}  PATH")
    for e in entries:
        print(f"{e['name']:<{width}}  {e['size_mb']:>7.1f}MB  {e['quantization']:<20}  {e['path']}")
    return 0
