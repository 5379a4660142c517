"""Where a 1024 x 128/128 maximum-load run spends its steps (fp8 dummy Llama-3.1-8B, batch 256): a histogram of
step wall times, and the model run (with a sync) and scheduling time per step. GPU only:
`python3 bench/step_profile.py [--format fp8]`."""
import argparse
import collections
import importlib.util
import time
from pathlib import Path

import torch

from lowbit.serve.sampling_params import SamplingParams


def load_serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).with_name("serve_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn, totals, key, sync=False):
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        if sync:
            torch.cuda.synchronize()
        totals[key] += time.perf_counter() - start
        return out
    return wrapper


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--format", default="fp8")
    a = p.parse_args(argv)
    sb = load_serve_bench()
    engine = sb.build_engine(sb.parse([]), a.format)
    totals = collections.Counter()
    engine.runner.run = timed(engine.runner.run, totals, "run", sync=True)
    engine.scheduler.schedule = timed(engine.scheduler.schedule, totals, "schedule")
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(sb.random_prompts(1024, 128, engine.runner.model.config["vocab_size"], seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    histogram, steps, start = collections.Counter(), 0, time.perf_counter()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        engine.step()
        histogram[5 * round(200 * (time.perf_counter() - step_start))] += 1  # 5 ms buckets
        steps += 1
    total = time.perf_counter() - start
    print(f"{a.format}: {steps} steps in {total:.2f} s = {1024 * 128 / total:.0f} output tok/s; per step "
          f"{1e3 * total / steps:.2f} ms, model run (+sync) {1e3 * totals['run'] / steps:.2f} ms, "
          f"schedule {1e3 * totals['schedule'] / steps:.2f} ms")
    for bucket, count in sorted(histogram.items()):
        print(f"  steps of ~{bucket} ms: {count}")


if __name__ == "__main__":
    main()
