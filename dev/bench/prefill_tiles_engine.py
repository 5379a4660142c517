"""The engine's prefill tiles against the ones before them (docs/benchmarks.md run 33), inside whole steps of the
dummy Llama-3.1-8B (GPU): a mixed step as 2048/128's (decodes first, then prompts) and a pure prefill step, each
under torch.profiler (kernel_profile.py's device times), in the order new, old, new. Answers whether a tile change
measured alone (dev/bench/prefill_tiles.py) shows in the steps the engine runs.

`python3 dev/bench/prefill_tiles_engine.py [--format fp8] [--mixed 300x2100+7600x1900] [--prefill 8192x2048]`
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.bench_cli import int_pairs  # noqa: E402
from lab import load_script  # noqa: E402
from lowbit.kernels.attention import paged_prefill as pp  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402

# bf16: the tiles before the seventh session's; FP8: the seventh session's, on the V-transposed cache (run 36)
PREVIOUS = {(False, False): pp.PrefillTiles(16, 64, 4, 3, blocks=True), (False, True): pp.PrefillTiles(16, 64, 4, 3),
            (True, False): pp.PrefillTiles(32, 64, 4, 3, True, True, True),
            (True, True): pp.PrefillTiles(32, 64, 4, 3, True, True, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="fp8")
    p.add_argument("--mixed", default="300x2100+7600x1900")
    p.add_argument("--prefill", default="8192x2048")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs an NVIDIA GPU (CUDA)")
    kp, sb = load_script("kernel_profile.py"), load_script("serve_bench.py")
    mixed, fill = int_pairs(p, "--mixed", a.mixed.replace("+", ",")), int_pairs(p, "--prefill", a.prefill)
    if len(mixed) != 2 or len(fill) != 1 or mixed[1][0] % mixed[1][1] or fill[0][0] % fill[0][1]:
        p.error("expected --mixed DECODESxCONTEXT+TOKENSxPROMPT_LENGTH and --prefill TOKENSxPROMPT_LENGTH, TOKENS a "
                "multiple of PROMPT_LENGTH")
    (dec, ctx), (tokens, length) = mixed
    (fill_tokens, fill_length), = fill
    engine = sb.build_engine(sb.parse(["--max-batch-size", str(dec + tokens // length), "--max-num-tokens",
                                       str(max(dec + tokens, fill_tokens))]), a.format)
    steps = {f"mixed {a.mixed}": kp.mixed_step(engine, dec, ctx, tokens, length),
             f"prefill {a.prefill}": kp.prefill_step(engine, fill_tokens, fill_length)}
    engine_tiles = dict(tuning.current().prefill_tiles)
    print("| tiles | step | kernels ms | prefill attention ms | decode attention ms | cuBLAS GEMMs ms |\n|---|---|---|---|---|---|")
    for name, tiles in (("engine", engine_tiles), ("previous", PREVIOUS), ("engine", engine_tiles)):
        with tuning.override(prefill_tiles=tiles):
            for label, step in steps.items():
                k = kp.profile(step, a.steps)
                ms = lambda keep: sum(us for n, (_, us) in k.items() if keep(n)) / 1e3  # noqa: E731
                print(f"| {name} | {label} | {ms(lambda n: True):.1f} | {ms(lambda n: '_prefill' in n):.2f} | "
                      f"{ms(lambda n: '_decode' in n or '_combine' in n):.2f} | "
                      f"{ms(lambda n: kp.group_of(n) == 'gemm_cublas'):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
