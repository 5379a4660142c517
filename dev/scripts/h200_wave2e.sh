#!/bin/bash
# The MoE router's top-k kernel and the fused-GEMV experiment on the GPU machine, from the repository root:
#   bash dev/scripts/h200_wave2e.sh tests     # the route kernel's GPU test, the Qwen3-MoE engine checks (5 formats)
#   bash dev/scripts/h200_wave2e.sh sweep     # dev/bench/moe_decode_fused.py: route kernel vs torch, fused GEMVs
#   bash dev/scripts/h200_wave2e.sh profile   # Qwen3-30B-A3B fp8 batch-1 decode step, kernel by kernel
#   bash dev/scripts/h200_wave2e.sh serve     # lowbit bench serve --model qwen3-30b-a3b fp8 (check, batch-1 decode,
#                                             # maximum load): this tree, then the tree before the route kernel
#                                             # (.old388 carried: `git archive 388e938 lowbit | tar -x -C .old388`)
#   bash dev/scripts/h200_wave2e.sh servefast # the same, this tree only, without the check phase
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
serve() {  # serve LABEL DIR FORMAT: the lowbit package under DIR (python -m puts the working directory first)
    (cd "$2" && PYTHONPATH=$PWD timeout 240 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b \
        --phases check,formats --formats "$3" --deadline-s 150 --num-requests 256 --json "$OUT/serve_$1.json" \
        --markdown "$OUT/serve_$1.md" 2>&1 | grep -E '^\[|Error|PASS|FAIL' | cut -c1-400)
}
for step in "$@"; do
echo "=== $step $(date -u +%H:%M:%S)"
case "$step" in
tests)
    PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_gpu.py \
        tests/test_dummy_qwen3_moe.py -k "route or qwen3_moe_kernels" 2>&1 | tee "$OUT/tests.log" | tail -4
    ;;
sweep)
    PYTHONPATH=$PWD timeout 240 python3 dev/bench/moe_decode_fused.py 2>&1 | tee "$OUT/sweep.log" \
        | grep -E "^#|^route|unfused moe|FAIL"
    ;;
profile)
    PYTHONPATH=$PWD timeout 200 python3 dev/bench/kernel_profile.py --model qwen3-30b-a3b --format fp8 \
        --decode 1x512 --prefill '' --top 40 --json "$OUT/profile_fp8.json" 2>&1 | grep -v '^\[lowbit\]' \
        | tee "$OUT/profile_fp8.log" | tail -60
    ;;
serve)
    serve fp8_route "$PWD" fp8
    serve fp8_before "$PWD/.old388" fp8
    ;;
servefast)
    PYTHONPATH=$PWD timeout 150 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases formats \
        --formats fp8 --num-requests 256 --json "$OUT/serve_fp8_route_only.json" 2>&1 | grep -E '^\[serve|Error' \
        | cut -c1-400
    ;;
esac
done
echo "=== done $(date -u +%H:%M:%S)"
