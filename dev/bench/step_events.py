"""Every device event of a few batch-1 decode steps, in order (GPU, dummy Llama-3.1-8B weights): kernels inside and
outside the decode graph, copies, and the idle gaps between them. One request (ISL 128), 30 steps untraced, then 20
steps under torch.profiler (CUDA activity). Writes one line per event (start us, duration us, gap before it us,
name) to --out-dir/events_FORMAT.txt and prints per name the count and device time per step.
`python3 dev/bench/step_events.py [--formats bf16,int4_awq] [--out-dir out]`
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import load_script  # noqa: E402
from lowbit.serve.engine.sampling_params import SamplingParams  # noqa: E402

STEPS = 20
FORMATS = ("bf16", "fp8", "int4_awq", "nvfp4")


def traced_events(engine, prompt) -> list[tuple[float, float, str]]:
    from torch.profiler import ProfilerActivity, profile

    engine.add_request("traced", prompt, SamplingParams(max_tokens=30 + STEPS + 10, temperature=0, ignore_eos=True))
    for _ in range(30):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int4_awq")
    ap.add_argument("--out-dir", default="out")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    if any(f not in FORMATS for f in formats):
        ap.error(f"--formats: each of {','.join(FORMATS)}, got {args.formats!r}")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    sb = load_script("serve_bench.py")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        engine = sb.build_engine(sb.parse(["--max-batch-size", "64"]), fmt)
        events = traced_events(engine, sb.random_prompts(1, 128, engine.runner.model.config["vocab_size"], 3)[0])
        lines, reach, per_name = [], events[0][0], collections.defaultdict(lambda: [0, 0.0])
        for start, end, name in events:
            lines.append(f"{start - events[0][0]:10.1f} {end - start:7.2f} {start - reach:7.2f} {name[:110]}")
            reach = max(reach, end)
            per_name[name[:60]][0] += 1
            per_name[name[:60]][1] += end - start
        (out / f"events_{fmt}.txt").write_text("\n".join(lines) + "\n")
        print(f"## {fmt}: {len(events) / STEPS:.0f} events per step, span {(reach - events[0][0]) / STEPS:.1f} us "
              f"per step (events_{fmt}.txt)")
        for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
            print(f"{n / STEPS:6.1f} x  {us / STEPS:8.2f} us  {name}")
        del engine
        sb.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
