"""`lowbit quantize` / `quantize`: a thin shell over lowbit.quantize()."""
from lowbit import models
from lowbit.recipe import available

EXAMPLES = f"""examples:
  quantize --recipe fp8                              # embedded {models.DEFAULT_MODEL} -> store entry {models.DEFAULT_MODEL}-fp8
  quantize --recipe int4_awq meta-llama/Llama-3.1-8B-Instruct -o ./llama8b-awq
  quantize --recipe ./my_recipe.yaml ./my-model --calib data.jsonl --num-samples 128 --force
  quantize --recipe auto --gate "kl<=0.05" --max-bits 6     # per-layer mix, the smallest that passes the gate
  quantize --recipe fp8 ./big-model --layer-by-layer         # one float layer in host memory, not the model
recipes: {', '.join(available())}, auto (or a path to a YAML file)"""


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
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB (default), 500MB, 2GiB; a larger checkpoint is "
                             "written as model-0000k-of-0000n.safetensors + model.safetensors.index.json")
    parser.add_argument("--layer-by-layer", action="store_true",
                        help="calibrate and export one decoder layer at a time: host memory holds one float layer, "
                             "not the model (max-calibrated recipes: fp8, fp8_dynamic, int4_rtn, nvfp4; dense models)")

    auto = parser.add_argument_group("--recipe auto (per-layer formats searched under an accuracy gate)")
    auto.add_argument("--gate", help='thresholds the result must pass, as for `lowbit eval`, e.g. "recovery>=0.99"')
    auto.add_argument("--max-bits", type=float, default=16.0,
                      help="size budget: average stored bits per quantized-linear weight, scales included (default 16)")
    auto.add_argument("--tasks", help="comma-separated eval tasks (default: those the gate's metrics need)")
    auto.add_argument("--limit", type=int, default=200, help="documents per eval task (default 200)")
    auto.add_argument("--confidence", type=float, default=0.95, help="the gate's one-sided confidence (see lowbit eval)")
    auto.add_argument("--trials", type=int, default=4, help="candidate mixes gated at most, smallest first (default 4)")
    auto.add_argument("--report", help="write the search and gate results as JSON")


def run(args) -> int:
    import lowbit
    from lowbit.errors import UserError

    if args.layer_by_layer and args.recipe == "auto":
        raise UserError("--layer-by-layer does not run --recipe auto (its search evaluates the whole model)")
    if args.recipe == "auto":
        return run_auto(args)
    if args.gate:
        raise UserError("--gate is for --recipe auto (gate another checkpoint with `lowbit eval`)")

    result = lowbit.quantize(args.model, recipe=args.recipe, out=args.out, calib=args.calib,
                             num_samples=args.num_samples, seq_len=args.seq_len, force=args.force,
                             export_format=args.export_format, max_shard_size=args.max_shard_size,
                             layer_by_layer=args.layer_by_layer)
    print(result.summary())
    return 0


def run_auto(args) -> int:
    """Exit 0 when a mix passes the gate, 1 when none does (the best tried is written and reported)."""
    import json

    from lowbit.errors import UserError
    from lowbit.evaluate.parallel import default_workers
    from lowbit.quantize.auto import AutoSettings, auto_quantize, print_report

    if not args.gate:
        raise UserError('--recipe auto needs --gate, e.g. --gate "recovery>=0.99"')
    for flag, value in (("--max-bits", args.max_bits), ("--limit", args.limit), ("--trials", args.trials)):
        if value <= 0:
            raise UserError(f"{flag} must be positive, got {value}")
    settings = AutoSettings(gate=args.gate, max_bits=args.max_bits, limit=args.limit, confidence=args.confidence,
                            trials=args.trials, workers=default_workers(),
                            tasks=[t for t in args.tasks.split(",") if t] if args.tasks else None)
    if args.num_samples:
        settings.calib_samples = args.num_samples
    if args.seq_len:
        settings.seq_len = args.seq_len
    code, report = auto_quantize(args.model, settings, out=args.out, force=args.force)
    print_report(report)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return code
