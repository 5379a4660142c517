"""Where a maximum-load run spends its steps (dummy Llama-3.1-8B, 1024 x 128/128 by default): a histogram of step
wall times, and per step the host's own time against the time it waits for the device's sampled tokens. With
overlapped steps the host works while the device computes, so a step that waits ~0 ms is host-bound and one that
waits is device-bound. GPU only: `python3 bench/step_profile.py [--format fp8] [--max-batch-size 512]`."""
import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.bench_cli import load_script  # noqa: E402
from lowbit.serve import engine as engine_module  # noqa: E402
from lowbit.serve.sampling_params import SamplingParams  # noqa: E402


def timed(fn, totals, key):
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        totals[key] += time.perf_counter() - start
        return out
    return wrapper


def run(engine, requests: int, isl: int, osl: int, seed: int) -> dict:
    """All requests at once; per step wall time, of which waiting for the device, scheduling, launching (and
    within launching: building the inputs, the graph replay call, queuing the sampler). GPU engines only."""
    totals = collections.Counter()
    in_flight_results = engine_module.InFlight.results
    engine_module.InFlight.results = timed(in_flight_results, totals, "wait")
    schedule, launch = engine.scheduler.schedule, engine._launch
    prepare, replay, sample = engine.runner.prepare, engine.runner.graphs.run, engine.sampler.sample
    engine.scheduler.schedule = timed(schedule, totals, "schedule")
    engine._launch = timed(launch, totals, "launch")  # of which:
    engine.runner.prepare = timed(prepare, totals, "launch.prepare")
    engine.runner.graphs.run = timed(replay, totals, "launch.graph_replay")
    engine.sampler.sample = timed(sample, totals, "launch.sample")
    try:
        params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
        sb = load_script("serve_bench.py")
        for i, prompt in enumerate(sb.random_prompts(requests, isl, engine.runner.model.config["vocab_size"], seed)):
            engine.add_request(f"p{seed}-{i}", prompt, params)
        histogram, steps, start = collections.Counter(), 0, time.perf_counter()
        while engine.has_unfinished():
            step_start = time.perf_counter()
            engine.step()
            histogram[2 * round(500 * (time.perf_counter() - step_start))] += 1  # 2 ms buckets
            steps += 1
        total = time.perf_counter() - start
    finally:
        engine_module.InFlight.results = in_flight_results
        engine.scheduler.schedule, engine._launch = schedule, launch
        engine.runner.prepare, engine.runner.graphs.run, engine.sampler.sample = prepare, replay, sample
    per_step = {k: round(1e3 * v / steps, 3) for k, v in totals.items()}
    return {"steps": steps, "seconds": round(total, 2), "output_tok_s": round(requests * osl / total),
            "ms_per_step": round(1e3 * total / steps, 3), "ms_per_step_parts": per_step,
            "histogram_ms": dict(sorted(histogram.items()))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--format", default="fp8")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--overlap", default="on,off", help="which runs: overlapped steps (on), not overlapped (off)")
    a = p.parse_args(argv)
    modes = {"on": (1, True), "off": (2, False)}
    if not a.overlap or set(a.overlap.split(",")) - set(modes):
        p.error(f"--overlap takes a comma-separated subset of {sorted(modes)}")
    sb = load_script("serve_bench.py")
    engine = sb.build_engine(sb.parse(["--max-batch-size", str(a.max_batch_size)]), a.format)
    run(engine, min(a.requests, 2 * a.max_batch_size), a.isl, 32, seed=5)  # warm-up: Triton compiles
    for seed, overlap in (modes[m] for m in a.overlap.split(",")):  # new prompts per run: no prefix-cache hits
        engine.overlap = overlap
        res = run(engine, a.requests, a.isl, a.osl, seed=seed)
        print(f"{a.format} batch {a.max_batch_size} overlap={overlap}: {res}", flush=True)


if __name__ == "__main__":
    main()
