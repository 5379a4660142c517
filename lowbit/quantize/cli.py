"""`lowbit quantize` / `quantize`: a thin shell over lowbit.quantize()."""
from lowbit import models
from lowbit.recipe import available

EXAMPLES = f"""examples:
  quantize --recipe fp8                              # embedded {models.DEFAULT_MODEL} -> store entry {models.DEFAULT_MODEL}-fp8
  quantize --recipe int4_awq meta-llama/Llama-3.1-8B-Instruct -o ./llama8b-awq
  quantize --recipe ./my_recipe.yaml ./my-model --calib data.jsonl --num-samples 128 --force
recipes: {', '.join(available())} (or a path to a YAML file)"""


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=models.DEFAULT_MODEL,
                        help=f"store name, local HF directory or hub id (default: {models.DEFAULT_MODEL})")
    parser.add_argument("--recipe", required=True, help="recipe name or path to a recipe YAML")
    parser.add_argument("-o", "--out", help="output directory (default: the store, as <model>-<recipe>)")
    parser.add_argument("--calib", help="calibration text: builtin:boolq, builtin:lambada, a .jsonl/.txt file, a dataset id")
    parser.add_argument("--num-samples", type=int, help="calibration sequences (overrides the recipe)")
    parser.add_argument("--seq-len", type=int, help="tokens per calibration sequence (overrides the recipe)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")
    parser.add_argument("--export-format", default="modelopt", choices=["modelopt", "compressed-tensors"],
                        help="checkpoint layout: modelopt (default) or compressed-tensors (what vLLM loads)")


def run(args) -> int:
    import lowbit

    result = lowbit.quantize(args.model, recipe=args.recipe, out=args.out, calib=args.calib,
                             num_samples=args.num_samples, seq_len=args.seq_len, force=args.force,
                             export_format=args.export_format)
    print(result.summary())
    return 0
