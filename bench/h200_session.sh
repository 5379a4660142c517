#!/bin/bash
# One device call that checks, then times, the GPU paths in order of importance (run 10 of docs/benchmarks.md had
# this shape). Each part has its own time limit, so a slow part cannot starve the ones after it; JSON and markdown
# go to $OUT (the device tool's output folder) or ./out. Run from the repository root: `bash bench/h200_session.sh`.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
part() { echo "== $(date -u +%H:%M:%S) $1"; }

part "engine vs reference, every format (overlapped steps included)"
timeout 150 python3 bench/serve_diag.py --phases check,replay --formats fp8,bf16,int4_awq,nvfp4 2>&1 | grep '"format"'
part "attention kernels and the sampler against their references"
timeout 90 python3 -m pytest -q tests/test_paged_attention.py tests/test_serve_sampler.py 2>&1 | tail -2
part "serving: batch 1 and maximum load, every format, HF baseline"
timeout 260 python3 bench/serve_bench.py --formats bf16,fp8,int4_awq,nvfp4 --phases hf,formats \
    --json "$OUT/serve.json" --markdown "$OUT/serve.md" 2>&1 | grep -E '^\['
part "where an FP8 maximum-load step goes"
timeout 80 python3 bench/step_profile.py --max-batch-size 256 2>&1 | tail -2
part "linear kernels against their references, then timed (FP8 and W4 at decode sizes)"
(cd bench && PYTHONPATH=.. timeout 150 python3 kernels.py --check --variants \
    bf16_cublas,fp8_scaled_mm,fp8_linear,fp8_rowwise_linear,w4_int4,w4_nvfp4 --m 1,16,256 --reps 5 \
    --json "../$OUT/kernels.json" 2>&1 | tail -30)
part done
