#!/bin/bash
# Second-wave GPU checks, part 3 (session 5), run from the repository root on the GPU machine with `.gpu` carried
# (wheels the machine lacks, a store with the embedded model's tokenizer; see h200_wave2b.sh for the checkpoint chunks):
#   bash dev/scripts/h200_wave2c.sh moetests   # MoE GPU tests: every expert format's fused kernels, the Qwen3-MoE engine
#   bash dev/scripts/h200_wave2c.sh moebench   # fused MoE vs per-expert loop, every expert format, 1-256 tokens
#   bash dev/scripts/h200_wave2c.sh moeserve   # Qwen3-30B-A3B int4_awq / nvfp4 experts: engine check, batch 1, 128/128
#   bash dev/scripts/h200_wave2c.sh moemax     # Qwen3-30B-A3B fp8: batch 1 and maximum load at 1000/1000
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LOWBIT_HOME=$PWD/.gpu/home OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps .gpu/wheels/*.whl 2>&1 | grep -v "as the .root. user" | tail -2
lb() { local t=$1; shift; timeout "$t" python3 -m lowbit.cli "$@" 2>&1 | grep -v '^\[lowbit\]'; }  # lb SECONDS ARGS
for step in "$@"; do
echo "=== $step $(date -u +%H:%M:%S)"
case "$step" in
moetests)
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_dummy_qwen3_moe.py tests/test_kernels_moe_gpu.py \
        tests/test_kernels_moe_fp8_per_token.py tests/test_kernels_moe_nvfp4.py tests/test_kernels_moe_int4.py -k gpu 2>&1 | tail -12
    ;;
moebench)
    timeout 150 python3 dev/bench/moe_kernel.py --formats bf16 fp8 fp8_pt int4 nvfp4 --batches 1 2 4 8 16 64 256 2>&1 | tail -60
    ;;
moeserve)
    lb 300 bench serve --model qwen3-30b-a3b --phases check,formats --formats int4_awq,nvfp4 --isl 128 --osl 128 \
        --deadline-s 60 --num-requests 256 --json "$OUT/moe_w4.json" --markdown "$OUT/moe_w4.md" | grep -E '^\[|Error' | cut -c1-500
    ;;
moemax)
    lb 330 bench serve --model qwen3-30b-a3b --phases formats --formats fp8 --deadline-s 150 \
        --json "$OUT/moe_fp8_1000.json" --markdown "$OUT/moe_fp8_1000.md" | grep -E '^\[|Error' | cut -c1-500
    ;;
esac
done
