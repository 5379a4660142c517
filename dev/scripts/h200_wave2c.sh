#!/bin/bash
# Second-wave GPU checks, part 3 (session 5), run from the repository root on the GPU machine with `.gpu` carried
# (wheels the machine lacks, a store with the embedded model's tokenizer; see h200_wave2b.sh for the checkpoint chunks):
#   bash dev/scripts/h200_wave2c.sh moetests   # MoE GPU tests: every expert format's fused kernels, the Qwen3-MoE engine
#   bash dev/scripts/h200_wave2c.sh moebench   # fused MoE vs per-expert loop, every expert format, 1-256 tokens
#   bash dev/scripts/h200_wave2c.sh moeserve   # Qwen3-30B-A3B int4_awq / nvfp4 experts: engine check, batch 1, 128/128
#   bash dev/scripts/h200_wave2c.sh moemax     # Qwen3-30B-A3B fp8: batch 1 and maximum load at 1000/1000
#   bash dev/scripts/h200_wave2c.sh zp         # zero points inside the W4 GEMV / w4_mma: checks, kernel times, layouts served
#   bash dev/scripts/h200_wave2c.sh moe2       # INT8 experts and the per-pair GEMV's tiles: GPU tests, tile sweep
#   bash dev/scripts/h200_wave2c.sh gputests   # engine graphs, dummy-weight engine, graphed verify step
#   (then h200_wave2b.sh unpack specreal2: n-gram drafting on the embedded model's fp8 checkpoint)
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
zp)
    timeout 150 python3 dev/bench/w4_zp_gemv_bench.py --json "$OUT/zp_m1.json" 2>&1 | tail -25
    timeout 100 python3 dev/bench/w4_zp_gemv_bench.py --m 8 2>&1 | tail -12
    lb 240 bench serve --model llama-3.1-8b --phases interop --max-batch-size 8 --json "$OUT/interop.json" \
        --markdown "$OUT/interop.md" | grep -E '^\[|Error' | cut -c1-400
    ;;
moe2)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_gpu.py tests/test_dummy_qwen3_moe.py \
        tests/test_kernels_moe_int8.py -k gpu 2>&1 | tail -8
    timeout 300 python3 dev/bench/moe_gemv_sweep.py 2>&1 | tee "$OUT/moe_gemv_sweep.log" | tail -40
    ;;
moe3)
    timeout 120 python3 dev/bench/moe_kernel.py --formats int8 fp8_pt --batches 1 8 64 256 2>&1 | tail -12
    lb 240 bench serve --model qwen3-30b-a3b --phases check,formats --formats w8a8_sq --isl 128 --osl 128 \
        --deadline-s 60 --num-requests 256 --json "$OUT/moe_int8.json" --markdown "$OUT/moe_int8.md" | grep -E '^\[|Error' | cut -c1-500
    ;;
gputests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine_graphs.py tests/test_gpu_engine_dummy.py \
        tests/test_gpu_spec_verify_graphs.py 2>&1 | tail -8
    ;;
esac
done
