#!/bin/bash
# Four device calls (each under the device tool's 10-minute limit) that check, then time, the GPU paths:
#   bash dev/bench/h200_session.sh check    # engine vs reference for every format, kernel tests, step and kernel profiles
#   bash dev/bench/h200_session.sh serve    # lowbit bench serve, FP8: batch 1, maximum load at batch 1024 and 512, extras
#   bash dev/bench/h200_session.sh formats  # lowbit bench serve: bf16, int4_awq, nvfp4 and the HF baseline
#   bash dev/bench/h200_session.sh trt      # FP8 2048/128 and 1000/1000 with TRT-LLM's request counts (3000 each)
#   bash dev/bench/h200_session.sh prefill  # prefill tiles inside whole steps (mixed and prefill), SM clock and power
#   bash dev/bench/h200_session.sh ncu      # Nsight Compute reports of FP8 / bf16 decode attention, INT4 GEMV, fp8_small_m
#   bash dev/bench/h200_session.sh ncugemv  # Nsight Compute of the W4, INT8 and bf16 one-row GEMVs on the up projection
#   bash dev/bench/h200_session.sh tiles    # FP8 decode and prefill tile candidates for the V-transposed cache
#   bash dev/bench/h200_session.sh w4       # W4A16 at M = 2-16: checks, sweep, times; int4_awq / nvfp4 decode steps
#   bash dev/bench/h200_session.sh compiles # 768 x 1000/1000: slow steps and the Triton kernels first built mid-run
#   bash dev/bench/h200_session.sh pdl      # decode-step graph replays of every format, PDL on and off (LOWBIT_PDL=0)
#   bash dev/bench/h200_session.sh splits   # decode attention at batch 1-16: the context-split counts, short and long
#   bash dev/bench/h200_session.sh dense    # the batch-1 bf16 GEMV and its FP8 variant (routed for small layers)
#   bash dev/bench/h200_session.sh m2       # the W4 GEMV on two x rows vs w4_small_m / tensor cores; batch-2 decode steps
#   bash dev/bench/h200_session.sh itl      # batch-1 ITL of every format (dev/bench/batch1_itl.py)
#   bash dev/bench/h200_session.sh w4big    # W4 at large M: dequantize + cuBLAS vs the tensor-core kernel; max load A / B
#   bash dev/bench/h200_session.sh mma      # W4 at M = 1-16 on mma.sync (w4_mma): checks, configs, engine check, A / B
#   bash dev/bench/h200_session.sh mid      # W4 at M = 16-512: checks, route vs dequant vs bf16, sweeps, engine check
#   bash dev/bench/h200_session.sh ncutc    # Nsight Compute of the W4 tensor-core kernel at 32 / 64 rows; lowbit bench kernels
#   bash dev/bench/h200_session.sh prefetch # that kernel with its scales loaded a K tile ahead (w4_prefetch_scales) or not
#   bash dev/bench/h200_session.sh int8     # INT8 (SmoothQuant) at M = 1-8 by dp4a: checks, times; w8a8_sq batch-1 A / B
#   bash dev/bench/h200_session.sh midserve # int4_awq / nvfp4 decode at batch 32 / 64, served at 64: this tree vs REF
# Each part has its own time limit, so a slow part cannot starve the ones after it; JSON and markdown go to $OUT
# (the device tool's output folder) or ./out. Run from the repository root.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
part() { echo "== $(date -u +%H:%M:%S) $1"; }
# ncu_report NAME KERNEL_REGEX TARGET_ARGS...: Nsight Compute (full set, clocks as they run) of one launch of
# dev/bench/ncu_targets.py TARGET_ARGS; the report and its details page as text go to $OUT/NAME.ncu-rep / .txt
ncu_report() {
    local name=$1 kern=$2
    shift 2
    timeout 150 ncu --clock-control none --set full -k "regex:$kern" -s 1 -c 1 -f -o "$OUT/$name" \
        python3 dev/bench/ncu_targets.py "$@" > /dev/null 2>&1
    ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
    echo "-- $name"
}

case "${1:-}" in
check)
    part "engine vs reference, every format (overlapped steps included); graph replay times"
    timeout 200 python3 dev/bench/serve_diag.py --phases check,replay --formats fp8,bf16,int4_awq,nvfp4 \
        --json "$OUT/diag.json" 2>&1 | grep '"format"'
    part "attention and sampler kernels against their references"
    timeout 120 python3 -m pytest -q tests/test_paged_attention.py tests/test_paged_prefill.py \
        tests/test_serve_sampler.py 2>&1 | tail -2
    part "W4 GEMV against its reference, then timed (its pytest file runs under the CPU interpreter only)"
    timeout 100 python3 dev/bench/w4_gemv_bench.py --json "$OUT/w4_gemv.json" 2>&1 | grep -E 'FAIL|per token'
    echo "w4_gemv_bench rc=${PIPESTATUS[0]}"
    part "where an FP8 maximum-load run's steps go (1024 x 128/128, batch 256)"
    timeout 90 python3 dev/bench/step_profile.py --max-batch-size 256 2>&1 | tail -2
    part "per-kernel device time of FP8 decode steps"
    timeout 90 python3 dev/bench/kernel_profile.py --format fp8 --decode 1x512,256x200,512x1500 --prefill 8192x2048 \
        --top 6 --json "$OUT/kernel_profile.json" 2>&1 | grep -A8 '^## '
    ;;
serve)
    part "FP8: batch 1, maximum load (1024 x 128/128 at batch 1024), 1000/1000 (768 and 896 requests: 945 fit) and 2048/128"
    timeout 420 python3 -m lowbit.bench.serve_bench --formats fp8 --phases formats,extra --max-batch-size 1024 \
        --extra 128/128/2048,1000/1000/768,1000/1000/896,2048/128/512 --deadline-s 380 \
        --json "$OUT/serve_fp8.json" --markdown "$OUT/serve_fp8.md" 2>&1 | grep -E '^\['
    part "FP8 maximum load at batch 512"
    timeout 120 python3 -m lowbit.bench.serve_bench --formats fp8 --phases formats --max-batch-size 512 \
        --json "$OUT/serve_fp8_512.json" 2>&1 | grep -E '^\['
    ;;
formats)
    # batch 1024: all 1024 requests in flight at once, as FP8's maximum load (W4: 17.3k against 15.5k at batch 512,
    # benchmarks.md run 48)
    part "serving: batch 1 and maximum load (batch 1024) of bf16, int4_awq, nvfp4; HF transformers at batch 64"
    timeout 540 python3 -m lowbit.bench.serve_bench --formats bf16,int4_awq,nvfp4 --phases hf,formats \
        --max-batch-size 1024 --deadline-s 480 --json "$OUT/serve.json" --markdown "$OUT/serve.md" 2>&1 | grep -E '^\['
    ;;
trt)
    part "FP8 maximum load with TRT-LLM's perf-overview request counts: 3000 x 2048/128, 3000 x 1000/1000"
    timeout 540 python3 -m lowbit.bench.serve_bench --formats fp8 --phases formats,extra --max-batch-size 1024 \
        --extra 2048/128/3000,1000/1000/3000 --deadline-s 300 --json "$OUT/serve_trt.json" 2>&1 | grep -E '^\['
    ;;
prefill)
    part "engine vs previous prefill tiles in a mixed step and a prefill step; SM clock / power every 100 ms"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > "$OUT/clocks.csv" &
    smi=$!
    timeout 200 python3 dev/bench/prefill_tiles_engine.py 2>&1 | grep -E '^\||Error'
    kill $smi
    part "SM clock while the card drew > 300 W"
    awk -F', ' 'NR > 1 && $3 + 0 > 300 {n++; c += $2 + 0; if (min == "" || $2 + 0 < min) min = $2 + 0}
        END {if (n) printf "%d samples: mean %.0f MHz, min %d MHz\n", n, c / n, min; else print "no loaded samples"}' \
        "$OUT/clocks.csv"
    part "where 2048/128's steps go (device spans of the slow ones)"
    timeout 150 python3 dev/bench/step_profile.py --max-batch-size 512 --requests 512 --isl 2048 --osl 128 \
        --overlap on --slow-ms 190 2>&1 | tail -20
    ;;
tiles)
    part "FP8 decode tiles on the V-transposed cache: the engine's against attention_tiles.py's EXPERIMENTS"
    timeout 200 python3 dev/bench/attention_tiles.py --variants blk64w2s3,blk32w2s3,blk32w2s4,blk64w2s3r168,blk64w2s4 \
        --budget-s 150 --json "$OUT/attention_tiles.json" 2>&1 | grep -E '^\||FAIL'
    part "FP8 prefill tiles on the V-transposed cache: the engine's (None) against the candidates that spill nothing"
    timeout 200 python3 dev/bench/prefill_tiles.py --kv fp8 --configs "None;(32, 64, 8, 3, True, True, True);\
(32, 32, 8, 3, True, True, True);(32, 64, 8, 2, True, True, True)" --json "$OUT/prefill_tiles.json" 2>&1 | grep -E '^\||FAIL'
    ;;
w4)
    part "W4A16 at M = 2-16 (w4_small_m and the tensor-core kernel) against the reference, then a sweep and times"
    timeout 330 python3 dev/bench/w4_small_m_bench.py --budget-s 150 --json "$OUT/w4_small_m.json" 2>&1 \
        | grep -v '"kind": "sweep"' | grep -v '"kind": "check".*PASS' | grep -v '"kind": "time"'
    part "engine vs reference, int4_awq and nvfp4"
    timeout 100 python3 dev/bench/serve_diag.py --phases check --formats int4_awq,nvfp4 2>&1 | grep '"format"' | cut -c1-300
    for f in int4_awq nvfp4; do
        part "$f decode steps at batch 2, 16, 64 (device time per step)"
        timeout 120 python3 dev/bench/kernel_profile.py --format $f --decode 2x512,16x512,64x512 --prefill '' --top 4 \
            2>&1 | grep -E '^## |^\| _'
    done
    ;;
compiles)
    part "FP8 768 x 1000/1000: steps over 400 ms and the Triton kernel variants first built during the run"
    timeout 250 python3 dev/bench/step_profile.py --max-batch-size 768 --requests 768 --isl 1000 --osl 1000 \
        --overlap on --slow-ms 400 --compiles 2>&1 | grep -E 'overlap=|slow step|first built|Error' \
        | sed 's/.histogram_ms.*//'
    ;;
pdl)
    for pdl in 1 0; do
        part "LOWBIT_PDL=$pdl: CUDA-graph replay of one decode step at batch 1 / 16 / 64 / 256, every format"
        LOWBIT_PDL=$pdl timeout 150 python3 dev/bench/serve_diag.py --phases replay --formats int4_awq,nvfp4,fp8,bf16 \
            --json "$OUT/replay_pdl$pdl.json" 2>&1 | grep '"format"'
    done
    ;;
splits)
    part "decode attention at batch 1-16, context 1024-32768: decode_splits' short and long-context split counts"
    timeout 200 python3 dev/bench/decode_splits.py --batches 1,2,4,8,16 --contexts 1024,2048,3072,4096,32768 --splits x1 \
        --json "$OUT/decode_splits.json" 2>&1 | grep -E '^\||failed'
    part "batch-1 decode with long prompts (ISL 8192 and 32000), int4_awq and fp8"
    timeout 300 python3 -m lowbit.bench.serve_bench --formats int4_awq,fp8 --phases formats --num-requests 16 \
        --max-batch-size 16 --isl 128 --osl 64 --latency-isl 8192,32000 --json "$OUT/serve_long.json" 2>&1 | grep -E '^\['
    ;;
dense)
    part "batch-1 GEMV: bf16 weights (the engine's) vs cuBLAS; FP8 weights vs the tensor-core route (fp8_small_m / _scaled_mm)"
    timeout 150 python3 dev/bench/dense_gemv_bench.py --configs "8,2048,8;16,1024,4;2,2048,8;4,512,2;8,512,2" \
        --json "$OUT/dense_gemv.json" 2>&1 | grep -E '^\||failed'
    timeout 180 python3 dev/bench/dense_gemv_bench.py --fp8 --configs "8,2048,4;4,2048,4;4,1024,2;8,1024,2" \
        --json "$OUT/fp8_gemv.json" 2>&1 | grep -E '^\||failed'
    ;;
m2)
    part "W4 GEMV with two x rows (GEMV_CONFIG_M2 and others) vs the route without it (w4_small_m / tensor-core kernel)"
    timeout 300 python3 dev/bench/w4_gemv_bench.py --m2 --configs "8,2048,2;4,1024,1;8,1024,1" \
        --json "$OUT/w4_gemv_m2.json" 2>&1 | grep -E 'FAIL|^#|per token|checks_done'
    for max_m in 1 2; do
        part "int4_awq / nvfp4 decode steps at batch 2 with w4_gemv_max_m = $max_m (device time per step)"
        timeout 100 python3 -c "
import sys; sys.path.insert(0, 'dev/bench')
from lab import load_script
from lowbit.kernels import tuning
kp = load_script('kernel_profile.py')
with tuning.override(w4_gemv_max_m=$max_m):
    for f in ('int4_awq', 'nvfp4'):
        kp.main(['--format', f, '--decode', '2x512', '--prefill', '', '--top', '3'])
" 2>&1 | grep -E '^## '
    done
    ;;
ncu)
    part "Nsight Compute (full set, clocks as they run) of one launch of each kernel; reports and text in \$OUT"
    for t in "decode_fp8 _decode_kernel decode --kv fp8" "decode_bf16 _decode_kernel decode --kv bf16" \
             "w4_int4 _w4_gemv_kernel w4 --fmt int4" "fp8_small_m _fp8_small_m_kernel fp8"; do
        ncu_report $t
        grep -E "^ +(Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|No Eligible) " "$OUT/${t%% *}.txt"
    done
    ;;
ncugemv)
    part "Nsight Compute of the one-row GEMVs on the up projection: W4 (INT4, NVFP4) against INT8 and bf16"
    for t in "gemv_int4 _w4_gemv_kernel w4 --fmt int4" "gemv_nvfp4 _w4_gemv_kernel w4 --fmt nvfp4" \
             "gemv_int8 _int8_gemv_kernel int8" "gemv_bf16 _dense_gemv_kernel bf16"; do
        ncu_report $t
        grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit Rate|L2 Hit Rate|Registers Per Thread|\
Achieved Occupancy|Theoretical Occupancy|No Eligible|Issued Warp Per Scheduler|Active Warps Per Scheduler|\
Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction|SM Active Cycles|Elapsed Cycles|Waves Per SM) " \
            "$OUT/${t%% *}.txt"
        grep -E "highest-utilized pipeline" "$OUT/${t%% *}.txt"
    done
    ;;
w4big)
    part "W4 at M = 64-4096: dequantize + cuBLAS (w4_dequant) vs the tensor-core kernel vs cuBLAS bf16, checked first"
    timeout 300 python3 dev/bench/w4_large_m_bench.py --json "$OUT/w4_large_m.json" 2>&1 | grep -E 'FAIL|^#|^\||failed'
    part "engine check, int4_awq and nvfp4 (the 200- and 700-token prompts take the dequant path)"
    timeout 100 python3 dev/bench/serve_diag.py --phases check --formats int4_awq,nvfp4 2>&1 | grep '"format"' | cut -c1-300
    for min_m in 1000000000 128; do
        part "int4_awq / nvfp4 at maximum load (1024 x 128/128, batch 512), w4_dequant_min_m = $min_m"
        timeout 120 python3 -c "
from lowbit.bench import serve_bench
from lowbit.kernels import tuning
with tuning.override(w4_dequant_min_m={'int4': $min_m, 'nvfp4': $min_m}):
    serve_bench.main(['--formats', 'int4_awq,nvfp4', '--phases', 'formats', '--max-batch-size', '512'])
" 2>&1 | grep -E '^\[' | sed 's/"graph_sizes[^]]*], //'
    done
    ;;
mma)
    part "INT4 / NVFP4 at M = 1-16 on mma.sync (w4_mma) vs the route without it and cuBLAS bf16, checked first"
    timeout 300 python3 dev/bench/w4_mma_bench.py --configs "16,1024,4;16,1024,2;32,1024,4" --json "$OUT/w4_mma.json" \
        2>&1 | grep -E 'FAIL|^#|^\||failed|^int4|^nvfp4'
    part "engine check, int4_awq and nvfp4 (short prompts and the batch-2 / 4 decode steps take w4_mma)"
    timeout 100 python3 dev/bench/serve_diag.py --phases check --formats int4_awq,nvfp4 2>&1 | grep '"format"' \
        | cut -c1-300
    for rows in "{}" "tuning.current().w4_mma_rows"; do
        part "int4_awq / nvfp4: decode steps at batch 1-16 (device time per step), then served 64 x 128/128 at batch 8
   and nvfp4 at batch 16; w4_mma_rows = $rows"
        timeout 200 python3 -c "
import sys; sys.path.insert(0, 'dev/bench')
from lab import load_script
from lowbit.bench import serve_bench as serve
from lowbit.kernels import tuning
with tuning.override(w4_mma_rows=$rows):
    for f in ('int4_awq', 'nvfp4'):
        load_script('kernel_profile.py').main(['--format', f, '--decode', '1x512,2x512,4x512,8x512,16x512',
                                               '--prefill', '', '--top', '3'])
    serve.main(['--formats', 'int4_awq,nvfp4', '--phases', 'formats', '--max-batch-size', '8', '--num-requests', '64'])
    serve.main(['--formats', 'nvfp4', '--phases', 'formats', '--max-batch-size', '16', '--num-requests', '128'])
" 2>&1 | grep -E '^## |^\['
    done
    ;;
mid)
    part "W4 at M = 16-512: the tensor-core kernel as routed vs dequant + cuBLAS vs cuBLAS bf16, checked first"
    timeout 330 python3 dev/bench/w4_mid_m_bench.py --m 16,24,48,96,128,192,256,384,512 --sweep 48,192 \
        --json "$OUT/w4_mid_m.json" 2>&1 | grep -E 'FAIL|^#|^\||failed|^best'
    part "INT4 / NVFP4 at M = 1-16: w4_mma vs the route without it (which now includes the new tensor-core kernel)"
    timeout 150 python3 dev/bench/w4_mma_bench.py --json "$OUT/w4_mma.json" 2>&1 | grep -E 'FAIL|^#|^\||failed'
    part "engine check, int4_awq and nvfp4 (prompts of 16-700 tokens take the tensor-core kernel or the dequant path)"
    timeout 100 python3 dev/bench/serve_diag.py --phases check --formats int4_awq,nvfp4 2>&1 | grep '"format"' \
        | cut -c1-300
    ;;
ncutc)
    part "Nsight Compute (full set) of the W4 tensor-core kernel on the up projection, INT4 at 32 rows, NVFP4 at 64"
    for t in "tc_int4_m32 int4 32" "tc_nvfp4_m64 nvfp4 64"; do
        set -- $t
        timeout 150 ncu --clock-control none --set full -k "regex:_w4_gemm_kernel" -s 1 -c 1 -f -o "$OUT/$1" \
            python3 dev/bench/ncu_targets.py w4tc --fmt "$2" --rows "$3" > /dev/null 2>&1
        ncu --import "$OUT/$1.ncu-rep" --page details > "$OUT/$1.txt" 2>&1
        ncu --import "$OUT/$1.ncu-rep" --page raw --csv > "$OUT/$1.csv" 2>&1
        echo "-- $1"
        grep -E "^ +(Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|No Eligible|Issue Slots Busy) " \
            "$OUT/$1.txt"
    done
    part "lowbit bench kernels: every kernel checked on the GPU, then timed at Llama-3.1-8B shapes"
    PYTHONPATH=$PWD timeout 330 python3 -m lowbit.bench.kernels --check --m 1,16,64,256,4096 --reps 10 \
        --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
    echo "kernels.py rc=$?"
    grep -ciE 'FAIL' "$OUT/kernels.txt"
    ;;
prefetch)
    for pf in False True; do
        part "W4 at M = 16-128, w4_prefetch_scales = $pf (the next K tile's scales loaded during this one)"
        timeout 150 python3 -c "
import sys; sys.path.insert(0, 'dev/bench')
from lab import load_script
from lowbit.kernels import tuning
with tuning.override(w4_prefetch_scales=$pf):
    code = load_script('w4_mid_m_bench.py').main('--m 16,32,64,128 --json $OUT/mid_prefetch_$pf.json'.split())
sys.exit(code)
" 2>&1 | grep -E 'FAIL|^#|^\||failed' | tail -14
    done
    part "engine check, int4_awq and nvfp4, with the defaults"
    timeout 100 python3 dev/bench/serve_diag.py --phases check --formats int4_awq,nvfp4 2>&1 | grep '"format"' \
        | cut -c1-300
    ;;
int8)
    part "INT8 at M = 1-8 by dp4a (int8_gemv) against the tensor-core int8 GEMM and cuBLAS bf16, checked first"
    timeout 180 python3 dev/bench/int8_gemv_bench.py --configs "8,2048,4;4,2048,4" --reps 10 --json "$OUT/int8.json" \
        2>&1 | grep -E 'FAIL|^#|^\||failed'
    for rows in 0 8; do
        part "w8a8_sq batch-1 ITL, int8_gemv_max_m = $rows"
        timeout 75 python3 dev/bench/batch1_itl.py --formats w8a8_sq --set "int8_gemv_max_m=$rows" \
            2>&1 | grep '"format"'
    done
    for rows in 0 8; do
        part "engine check, w8a8_sq (kernels + graphs against the fp32 reference path), int8_gemv_max_m = $rows"
        timeout 60 python3 -c "
from lowbit.bench import serve_bench
from lowbit.kernels import tuning
with tuning.override(int8_gemv_max_m=$rows):
    serve_bench.main(['--formats', 'w8a8_sq', '--phases', 'check', '--json', '$OUT/check_$rows.json'])
" 2>&1 | grep -E '^\[' | cut -c1-200
    done
    ;;
midserve)
    ref=${REF:-HEAD}
    rm -rf /tmp/ref && mkdir -p /tmp/ref && git archive "$ref" | tar -x -C /tmp/ref
    for tree in /tmp/ref "$PWD"; do
        part "$tree: int4_awq / nvfp4 decode steps at batch 32 / 64 (device time), served 256 x 128/128 at batch 64"
        (cd "$tree" && timeout 270 python3 -c "
import sys; sys.path.insert(0, 'dev/bench')
from lab import load_script
for f in ('int4_awq', 'nvfp4'):
    load_script('kernel_profile.py').main(['--format', f, '--decode', '32x512,64x512', '--prefill', '', '--top', '3'])
load_script('serve_bench.py').main(['--formats', 'int4_awq,nvfp4', '--phases', 'formats', '--max-batch-size', '64',
                                    '--num-requests', '256'])
" 2>&1 | grep -E '^## |^\[')
    done
    ;;
itl)
    part "batch-1 ITL of every format (ISL 128, OSL 256, three requests each)"
    timeout 300 python3 dev/bench/batch1_itl.py --formats bf16,int4_awq,nvfp4,fp8 2>&1 | grep '"format"'
    ;;
*)
    echo "usage: bash dev/bench/h200_session.sh check|serve|formats|trt|prefill|ncu|tiles|w4|compiles|pdl|splits|dense|m2|itl|w4big|mma|mid|ncutc|prefetch|int8|midserve|ncugemv" >&2
    exit 2
    ;;
esac
part done
