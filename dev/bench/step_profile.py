"""Where a maximum-load run spends its steps (dummy Llama-3.1-8B, 1024 x 128/128 by default): a histogram of step
wall times, and per step the host's own time against the time it waits for the device's sampled tokens. With
overlapped steps the host works while the device computes, so a step that waits ~0 ms is host-bound and one that
waits is device-bound. GPU only: `python3 dev/bench/step_profile.py [--format fp8] [--max-batch-size 512]`.
`--trace 40:46` also records the device's kernels of those steps (torch.profiler) and lists where the device sat
idle between them, with the kernels on either side of each gap."""
import argparse
import collections
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lab import load_script  # noqa: E402
from lowbit.serve.engine import engine as engine_module  # noqa: E402
from lowbit.serve.engine.sampling_params import SamplingParams  # noqa: E402


def timed(fn, totals, key):
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        totals[key] += time.perf_counter() - start
        return out
    return wrapper


def composition(batch) -> str:
    """'D decodes + P prompt chunks (T tokens, longest L)' of a scheduled batch; '-' for none."""
    if batch is None:
        return "-"
    chunks = [n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.in_prefill or n > 1]
    return (f"{len(batch.seqs) - len(chunks)} decodes + {len(chunks)} prompt chunks ({sum(chunks)} tokens, longest "
            f"{max(chunks, default=0)})")


def recording(schedule, scheduled: list):
    """schedule, appending each batch's composition to `scheduled` (outside the timed call)."""
    def wrapper():
        batch = schedule()
        scheduled.append(composition(batch))
        return batch
    return wrapper


def evented(launch, spans: dict, step_no: list):
    """launch, with CUDA events recorded before and after it into spans[step_no[0]]: the device's time from the
    step's first kernel to its last, idle gaps included."""
    def wrapper(batch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = launch(batch)
        end.record()
        spans[step_no[0]] = (start, end)
        return out
    return wrapper


def device_gaps(intervals: list, top: int = 8) -> dict:
    """intervals [(start_us, end_us, name)] of device activity -> the span from the first start to the last end,
    the time some activity ran (their union) and the `top` longest idle gaps, each with the names either side (ms)."""
    if not intervals:
        raise ValueError("the trace recorded no device activity")
    intervals = sorted(intervals)
    busy, gaps, reach, last = 0.0, [], intervals[0][0], intervals[0][2]
    for start, end, name in intervals:
        if start > reach:
            gaps.append((start - reach, last, name))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, last = end, name
    gaps.sort(key=lambda g: -g[0])
    return {"span_ms": round((reach - intervals[0][0]) / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "idle_ms": round(sum(g[0] for g in gaps) / 1e3, 2), "gaps": len(gaps),
            "longest": [(round(us / 1e3, 3), before[:60], after[:60]) for us, before, after in gaps[:top]]}


def cuda_intervals(prof) -> list:
    """The device activity (kernels, copies, sets) a torch.profiler run recorded, as device_gaps' intervals."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_totals(intervals: list, top: int = 10) -> dict:
    """{name: ms} of the `top` names with the most device time in the intervals."""
    totals = collections.Counter()
    for start, end, name in intervals:
        totals[name[:60]] += (end - start) / 1e3
    return {name: round(ms, 2) for name, ms in totals.most_common(top)}


class StepTrace:
    """torch.profiler (CUDA activity only) over steps first..stop-1 of a run; `result`: their wall time, device_gaps
    and kernel_totals."""

    def __init__(self, first: int, stop: int):
        self.first, self.stop, self.prof, self.result = first, stop, None, None

    def before_step(self, step: int) -> None:
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile as torch_profile
            self.prof, self.start = torch_profile(activities=[ProfilerActivity.CUDA]), time.perf_counter()
            self.prof.__enter__()
        elif step == self.stop and self.prof is not None:
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - self.start
            self.prof.__exit__(None, None, None)
            intervals, self.prof = cuda_intervals(self.prof), None
            self.result = {"steps": f"{self.first}:{self.stop}", "wall_ms": round(1e3 * wall_s, 1),
                           **device_gaps(intervals), "kernels_ms": kernel_totals(intervals)}

    def after_run(self, steps: int) -> None:
        if steps == self.stop:  # the traced steps were the run's last
            self.before_step(steps)
        if self.result is None:
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
            raise ValueError(f"--trace {self.first}:{self.stop}: the run ended after {steps} steps")


def watch_compiles(step_no: list, compiled: list):
    """Sets Triton's hook before every new kernel variant (a specialization not yet in memory: a compile, ~1 s, or
    a disk-cache load) to record [step, kernel]. Returns a function that puts the previous hook back."""
    import triton

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append([step_no[0], fn.name])
        return None  # go on compiling
    runtime = triton.knobs.runtime
    previous, runtime.jit_cache_hook = runtime.jit_cache_hook, hook
    return lambda: setattr(runtime, "jit_cache_hook", previous)


def run(engine, requests: int, isl: int, osl: int, seed: int, slow_ms: float = 0.0, trace=None,
        compiles: bool = False) -> dict:
    """All requests at once; per step wall time, of which waiting for the device, scheduling, launching (and
    within launching: building the inputs, the graph replay call, queuing the sampler). GPU engines only.
    slow_ms > 0: also lists the steps slower than that, with what they and the step before scheduled (with
    overlapped steps a step's wall time is mostly the device time of the step launched before it).
    trace (first, stop): device_gaps of steps first..stop-1 under torch.profiler (CUDA activity only).
    compiles: also lists the Triton kernel variants first built during the run, with their step."""
    totals = collections.Counter()
    in_flight_results = engine_module.InFlight.results
    engine_module.InFlight.results = timed(in_flight_results, totals, "wait")
    schedule, launch = engine.scheduler.schedule, engine._launch
    graphs = engine.runner.graphs  # None on the CPU (a plumbing check only)
    host_inputs, replay, sample = engine.runner.host_inputs, graphs and graphs.run, engine.sampler.sample
    engine.scheduler.schedule = timed(schedule, totals, "schedule")
    engine._launch = timed(launch, totals, "launch")  # of which:
    scheduled, spans, step_no = [], {}, [0]  # with slow_ms: per step what it scheduled, CUDA events around its launch
    if slow_ms:
        engine.scheduler.schedule = recording(engine.scheduler.schedule, scheduled)
        if engine.runner.device.type == "cuda":
            engine._launch = evented(engine._launch, spans, step_no)
    engine.runner.host_inputs = timed(host_inputs, totals, "launch.host_inputs")
    if graphs:
        graphs.run = timed(replay, totals, "launch.graph_replay")  # with the inputs' upload and load
    engine.sampler.sample = timed(sample, totals, "launch.sample")
    compiled = []
    unwatch = watch_compiles(step_no, compiled) if compiles else None
    try:
        params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
        sb = load_script("serve_bench.py")
        for i, prompt in enumerate(sb.random_prompts(requests, isl, engine.runner.model.config["vocab_size"], seed)):
            engine.add_request(f"p{seed}-{i}", prompt, params)
        histogram, steps, start, slow = collections.Counter(), 0, time.perf_counter(), []
        tracer = StepTrace(*trace) if trace else None
        while engine.has_unfinished():
            if tracer:
                tracer.before_step(steps)
            step_start = time.perf_counter()
            step_no[0] = steps
            engine.step()
            ms = 1e3 * (time.perf_counter() - step_start)
            histogram[2 * round(ms / 2)] += 1  # 2 ms buckets
            if slow_ms and ms > slow_ms:
                slow.append({"step": steps, "ms": round(ms, 1), "this": scheduled[-1],
                             "before": scheduled[-2] if len(scheduled) > 1 else "-"})
            steps += 1
        total = time.perf_counter() - start
        if tracer:
            tracer.after_run(steps)
        if spans:
            torch.cuda.synchronize()
        device_ms = {k: round(a.elapsed_time(b), 1) for k, (a, b) in spans.items()}  # device time of launch k
        for row in slow:
            row["device_ms"] = {k: device_ms.get(row["step"] + k) for k in (-1, 0)}
    finally:
        engine_module.InFlight.results = in_flight_results
        engine.scheduler.schedule, engine._launch = schedule, launch
        engine.runner.host_inputs, engine.sampler.sample = host_inputs, sample
        if graphs:
            graphs.run = replay
        if unwatch:
            unwatch()
    per_step = {k: round(1e3 * v / steps, 3) for k, v in totals.items()}
    return {"steps": steps, "seconds": round(total, 2), "output_tok_s": round(requests * osl / total),
            "ms_per_step": round(1e3 * total / steps, 3), "ms_per_step_parts": per_step,
            "histogram_ms": dict(sorted(histogram.items())), **({"slow_steps": slow} if slow_ms else {}),
            **({"trace": tracer.result} if trace else {}), **({"compiled": compiled} if compiles else {})}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--format", default="fp8")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--overlap", default="on,off", help="which runs: overlapped steps (on), not overlapped (off)")
    p.add_argument("--slow-ms", type=float, default=0.0, help="list the steps slower than this (0: none)")
    p.add_argument("--trace", default="", help="FIRST:STOP: the device's idle gaps in steps FIRST..STOP-1")
    p.add_argument("--no-gc", action="store_true", help="Python's garbage collector off during the measured runs")
    p.add_argument("--compiles", action="store_true", help="list Triton kernel variants first built mid-run")
    a = p.parse_args(argv)
    modes = {"on": (1, True), "off": (2, False)}
    if not a.overlap or set(a.overlap.split(",")) - set(modes):
        p.error(f"--overlap takes a comma-separated subset of {sorted(modes)}")
    trace = None
    if a.trace:
        first, _, stop = a.trace.partition(":")
        if not (first.isdigit() and stop.isdigit() and int(first) < int(stop)):
            p.error("--trace takes FIRST:STOP, two step numbers with FIRST < STOP")
        trace = (int(first), int(stop))
    sb = load_script("serve_bench.py")
    engine = sb.build_engine(sb.parse(["--max-batch-size", str(a.max_batch_size)]), a.format)
    run(engine, min(a.requests, 2 * a.max_batch_size), a.isl, 32, seed=5)  # warm-up: Triton compiles
    for seed, overlap in (modes[m] for m in a.overlap.split(",")):  # new prompts per run: no prefix-cache hits
        engine.overlap = overlap
        if a.no_gc:
            gc.collect()
            gc.disable()
        res = run(engine, a.requests, a.isl, a.osl, seed=seed, slow_ms=a.slow_ms, trace=trace, compiles=a.compiles)
        gc.enable()
        slow, traced, compiled = res.pop("slow_steps", []), res.pop("trace", None), res.pop("compiled", None)
        print(f"{a.format} batch {a.max_batch_size} overlap={overlap} gc={'off' if a.no_gc else 'on'}: {res}",
              flush=True)
        for row in slow:
            print(f"  slow step {row['step']}: {row['ms']} ms (device: launched before {row['device_ms'][-1]} ms, "
                  f"this {row['device_ms'][0]} ms); this: {row['this']}; before: {row['before']}")
        if compiled is not None:
            print(f"  kernel variants first built during the run: {compiled or 'none'}")
        if traced:
            longest = traced.pop("longest")
            print(f"  trace: {traced}")
            for ms, before, after in longest:
                print(f"    idle {ms} ms between {before} and {after}")


if __name__ == "__main__":
    main()
