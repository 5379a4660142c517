"""Peak host memory of `quantize --layer-by-layer` on a random-weight Llama-shaped model of ~1.3 GB (bf16 on disk,
2.6 GB as the float32 model the whole-model path loads), against the whole-model path on the same model.

    python3 dev/bench/layerwise_peak_rss.py [--layers 10] [--whole] [--keep DIR]

Each quantize runs in a fresh child process; printed: the child's RSS after imports, its peak RSS (VmHWM), the
growth between them, and ru_maxrss of the children (resource.getrusage RUSAGE_CHILDREN), all in MiB.
"""
import argparse
import shutil
import tempfile
import time
from pathlib import Path

from transformers import LlamaConfig

from lowbit.testing.random_model import quantize_peak, write_random_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--recipe", default="fp8")
    p.add_argument("--whole", action="store_true", help="also run the whole-model path (needs ~2x the fp32 model)")
    p.add_argument("--keep", help="write the model here (and keep it) instead of a temporary directory")
    args = p.parse_args()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                      tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        t0 = time.time()
        if (root / "src" / "config.json").is_file():  # --keep DIR from an earlier run: the same model again
            size = sum(f.stat().st_size for f in (root / "src").glob("*.safetensors"))
        else:
            size = write_random_model(root / "src", cfg)
        print(f"model: {args.layers} layers, hidden {args.hidden}, {size / 2**20:.0f} MiB bf16 on disk "
              f"({2 * size / 2**20:.0f} MiB as float32), ready in {time.time() - t0:.0f} s")
        runs = [True, False] if args.whole else [True]
        for layer_by_layer in runs:  # layer by layer first: ru_maxrss is the largest child so far
            t0 = time.time()
            shutil.rmtree(root / f"out-{layer_by_layer}", ignore_errors=True)
            r = quantize_peak(root / "src", root / f"out-{layer_by_layer}", args.recipe, layer_by_layer)
            mib = {k: v / 2**20 for k, v in r.items()}
            print(f"{'layer by layer' if layer_by_layer else 'whole model   '}: RSS after imports {mib['start']:.0f},"
                  f" peak {mib['hwm']:.0f}, growth {mib['hwm'] - mib['start']:.0f}, children ru_maxrss "
                  f"{mib['maxrss']:.0f} MiB ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
