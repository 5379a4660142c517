"""cProfile of the engine's host work in speculative steps on the CPU: `lowbit bench spec --host-only`'s scripted
stub forward on its quoting script, one run of --batch requests.
PYTHONPATH=. python3 dev/bench/spec_host_profile.py [--k 8] [--batch 1] [--out 2048] [--plain] [--profile]"""
import argparse
import cProfile
import pstats
import time

import torch

from lowbit.bench.spec_host import engine_for, timed_run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", type=int, default=2048)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    args = argparse.Namespace(passage=128, output_len=a.out, tps_batch_sizes=[a.batch], num_draft_tokens=a.k)
    engine, prompt = engine_for(args, "quote")
    spec = None if a.plain else engine.spec
    timed_run(engine, prompt, a.batch, 16, spec)  # first-step costs outside
    profile = cProfile.Profile() if a.profile else None
    if profile:
        profile.enable()
    t0 = time.perf_counter()
    seconds, _ = timed_run(engine, prompt, a.batch, a.out, spec)
    wall = time.perf_counter() - t0
    if profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    print(f"{'plain' if a.plain else f'n-gram k={a.k}'} batch {a.batch}: {a.batch * a.out} tokens, "
          f"{1e3 * seconds:.1f} ms CPU ({1e3 * wall:.1f} ms wall)")


if __name__ == "__main__":
    main()
