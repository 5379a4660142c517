#!/bin/bash
# Qwen3-MoE batch-1 decode on the GPU machine, from the repository root (q/k RMSNorm fused into rotary + K/V store):
#   bash dev/scripts/h200_wave2f.sh diff      # dev/bench/moe_route_diff.py --format nvfp4: where the two paths route
#                                             # differently, step by step, with the reference's router gap there
#   bash dev/scripts/h200_wave2f.sh tests     # the rotary/q-k-norm, MoE and graph GPU tests
#   bash dev/scripts/h200_wave2f.sh checks    # engine checks: Qwen3-MoE (5 formats), Gemma 3 (bf16, fp8)
#   bash dev/scripts/h200_wave2f.sh formats   # batch 1 and 256 x 128/128 of bf16, int4_awq, nvfp4, w8a8_sq experts
#   bash dev/scripts/h200_wave2f.sh moemax    # fp8: batch 1 and maximum load at 768 x 1000/1000
#   bash dev/scripts/h200_wave2f.sh profile   # Qwen3-30B-A3B fp8 batch-1 decode step, kernel by kernel
#   bash dev/scripts/h200_wave2f.sh decode    # lowbit bench serve --model qwen3-30b-a3b fp8 (batch-1 decode, maximum
#                                             # load): this tree, then .oldmain (carried: `git archive HEAD lowbit |
#                                             # tar -x -C .oldmain` of the commit before the change)
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
decode() {  # decode LABEL DIR: the lowbit package under DIR
    (cd "$2" && PYTHONPATH=$PWD timeout 200 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases formats \
        --formats fp8 --num-requests 256 --json "$OUT/serve_fp8_$1.json" 2>&1 | grep -E '^\[serve|Error' | cut -c1-400)
}
for step in "$@"; do
echo "=== $step $(date -u +%H:%M:%S)"
case "$step" in
diff)
    PYTHONPATH=$PWD timeout 200 python3 dev/bench/moe_route_diff.py --format nvfp4 2>&1 | tee "$OUT/diff.log" \
        | grep -v '^\[lowbit\]' | cut -c1-600
    ;;
tests)
    PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_rotary_kv.py \
        tests/test_kernels_moe_gpu.py tests/test_dummy_qwen3_moe.py tests/test_gpu_engine_graphs.py \
        tests/test_route_ties.py -k "not qwen3_moe_kernels" 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|Error|assert" | cut -c1-600 \
        | tail -12
    ;;
checks)  # the engine checks: Qwen3-MoE in five formats, Gemma 3 (per-head q/k norms too) in two
    for model in qwen3-30b-a3b:bf16,fp8,int4_awq,nvfp4,w8a8_sq gemma-3-12b:bf16,fp8; do
        PYTHONPATH=$PWD timeout 300 python3 -m lowbit.cli bench serve --model ${model%%:*} --phases check \
            --formats ${model##*:} --check-layers 2 --json "$OUT/check_${model%%:*}.json" 2>&1 \
            | grep -E '^\[check|Error' | grep -oE '^\[check[^ ]* [0-9.]+s|"(batch[12]_)?(logits_rel_err_max|router_tie_steps)": [^,]*|"pass": [a-z]*|Error.*'
    done
    ;;
profile)
    PYTHONPATH=$PWD timeout 200 python3 dev/bench/kernel_profile.py --model qwen3-30b-a3b --format fp8 \
        --decode 1x512 --prefill '' --top 40 --json "$OUT/profile_fp8.json" 2>&1 | grep -v '^\[lowbit\]' \
        | tee "$OUT/profile_fp8.log" | tail -45
    ;;
decode)
    decode fused "$PWD"
    decode before "$PWD/.oldmain"
    ;;
formats)  # batch 1 and maximum load at 256 x 128/128 of the other expert kinds, this tree
    PYTHONPATH=$PWD timeout 420 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases formats \
        --formats bf16,int4_awq,nvfp4,w8a8_sq --num-requests 256 --json "$OUT/serve_formats.json" 2>&1 \
        | grep -E '^\[serve|Error' | cut -c1-300
    ;;
moemax)  # fp8: batch 1, then maximum load at 768 x 1000/1000
    PYTHONPATH=$PWD timeout 420 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases formats,extra \
        --formats fp8 --num-requests 256 --extra 1000/1000/768 --json "$OUT/serve_fp8_1000.json" 2>&1 \
        | grep -E '^\[|Error' | cut -c1-400
    ;;
esac
done
echo "=== done $(date -u +%H:%M:%S)"
