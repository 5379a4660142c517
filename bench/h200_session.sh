#!/bin/bash
# Two device calls (each under the device tool's 10-minute limit) that check, then time, the GPU paths:
#   bash bench/h200_session.sh check   # engine vs reference for every format, kernel tests, step and kernel profiles
#   bash bench/h200_session.sh serve   # lowbit bench serve: batch 1 and maximum load, every format, HF, FP8 extras
# Each part has its own time limit, so a slow part cannot starve the ones after it; JSON and markdown go to $OUT
# (the device tool's output folder) or ./out. Run from the repository root.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
part() { echo "== $(date -u +%H:%M:%S) $1"; }

case "${1:-}" in
check)
    part "engine vs reference, every format (overlapped steps included); graph replay times"
    timeout 200 python3 bench/serve_diag.py --phases check,replay --formats fp8,bf16,int4_awq,nvfp4 \
        --json "$OUT/diag.json" 2>&1 | grep '"format"'
    part "attention and sampler kernels against their references"
    timeout 120 python3 -m pytest -q tests/test_paged_attention.py tests/test_paged_prefill.py \
        tests/test_serve_sampler.py 2>&1 | tail -2
    part "W4 GEMV against its reference, then timed (its pytest file runs under the CPU interpreter only)"
    timeout 100 python3 bench/w4_gemv_bench.py --json "$OUT/w4_gemv.json" 2>&1 | grep -E 'FAIL|per token'
    echo "w4_gemv_bench rc=${PIPESTATUS[0]}"
    part "where an FP8 maximum-load run's steps go (1024 x 128/128, batch 256)"
    timeout 90 python3 bench/step_profile.py --max-batch-size 256 2>&1 | tail -2
    part "per-kernel device time of FP8 decode steps"
    timeout 90 python3 bench/kernel_profile.py --format fp8 --decode 1x512,256x200,512x1500 --prefill 8192x2048 \
        --top 6 --json "$OUT/kernel_profile.json" 2>&1 | grep -A8 '^## '
    ;;
serve)
    part "serving: batch 1 and maximum load, every format, HF baseline, FP8 at 1000/1000 and 2048/128"
    timeout 540 python3 bench/serve_bench.py --formats fp8,bf16,int4_awq,nvfp4 --phases hf,formats,extra \
        --max-batch-size 512 --extra 1000/1000/512,2048/128/512 --deadline-s 420 \
        --json "$OUT/serve.json" --markdown "$OUT/serve.md" 2>&1 | grep -E '^\['
    ;;
*)
    echo "usage: bash bench/h200_session.sh check|serve" >&2
    exit 2
    ;;
esac
part done
