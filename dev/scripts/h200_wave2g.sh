#!/bin/bash
# Qwen3-MoE batch-1 decode on the GPU machine, from the repository root (MoE decode path: gate/up + SiLU and down +
# combine in two launches; the router's GEMV + top-k in one; the decode kernel's own split combine):
#   bash dev/scripts/h200_wave2g.sh on        # switch those on in sm90.py (this copy of the tree: main has them off)
#   bash dev/scripts/h200_wave2g.sh sweep     # dev/bench/moe_decode_sweep.py: the new kernels' tiles, old vs new
#   bash dev/scripts/h200_wave2g.sh tests     # the MoE, route and graph GPU tests
#   bash dev/scripts/h200_wave2g.sh checks    # engine checks: Qwen3-MoE (5 formats)
#   bash dev/scripts/h200_wave2g.sh profile   # Qwen3-30B-A3B fp8 batch-1 decode step, kernel by kernel
#   bash dev/scripts/h200_wave2g.sh decode    # lowbit bench serve --model qwen3-30b-a3b fp8: this tree, then .oldmain
#                                             # (`git archive main lowbit | tar -x -C .oldmain` before the change)
#   bash dev/scripts/h200_wave2g.sh formats   # batch 1 and 256 x 128/128 of bf16, int4_awq, nvfp4, w8a8_sq experts
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
on)
    sed -i -e 's/^    moe_decode_max_pairs=0,/    moe_decode_max_pairs=64,/' \
        -e 's/^    moe_router_topk_max_tokens=0,/    moe_router_topk_max_tokens=1,/' \
        -e 's/^    decode_fused_combine_max_pairs=0,/    decode_fused_combine_max_pairs=65536,/' lowbit/kernels/tuning/sm90.py
    grep -nE "^    (moe_decode_max_pairs|moe_router_topk_max_tokens|decode_fused_combine_max_pairs)=" \
        lowbit/kernels/tuning/sm90.py
    ;;
sweep)
    PYTHONPATH=$PWD timeout 420 python3 dev/bench/moe_decode_sweep.py 2>&1 | tee "$OUT/sweep.log" | grep -v '^\[lowbit\]' \
        | cut -c1-300
    ;;
tests)
    PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_gpu.py \
        tests/test_paged_attention.py tests/test_dummy_qwen3_moe.py tests/test_gpu_engine_graphs.py \
        tests/test_route_ties.py 2>&1 | tee "$OUT/tests.log" \
        | grep -E "passed|failed|Error|assert" | cut -c1-600 | tail -15
    ;;
checks)
    PYTHONPATH=$PWD timeout 300 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases check \
        --formats bf16,fp8,int4_awq,nvfp4,w8a8_sq --check-layers 2 --json "$OUT/check_qwen3-30b-a3b.json" 2>&1 \
        | grep -E '^\[check|Error' \
        | grep -oE '^\[check[^ ]* [0-9.]+s|"(batch[12]_)?(logits_rel_err_max|router_tie_steps)": [^,]*|"pass": [a-z]*|Error.*'
    ;;
profile)
    PYTHONPATH=$PWD timeout 200 python3 dev/bench/kernel_profile.py --model qwen3-30b-a3b --format fp8 \
        --decode 1x512 --prefill '' --top 40 --json "$OUT/profile_fp8.json" 2>&1 | grep -v '^\[lowbit\]' \
        | tee "$OUT/profile_fp8.log" | tail -30
    ;;
decode)
    decode new "$PWD"
    decode before "$PWD/.oldmain"
    ;;
formats)
    PYTHONPATH=$PWD timeout 420 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases formats \
        --formats bf16,int4_awq,nvfp4,w8a8_sq --num-requests 256 --json "$OUT/serve_formats.json" 2>&1 \
        | grep -E '^\[serve|Error' | cut -c1-300
    ;;
esac
done
echo "=== done $(date -u +%H:%M:%S)"
