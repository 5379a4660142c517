#!/bin/bash
# NVFP4 MoE GEMV tiles on the GPU machine, from the repository root (nothing to carry):
#   bash dev/scripts/h200_wave2d.sh
# sweeps the tiles (dev/bench/moe_gemv_sweep.py), writes the winner into this copy's sm90.py, then runs the NVFP4
# MoE GPU tests and `lowbit bench serve --model qwen3-30b-a3b --formats nvfp4` (batch-1 decode, maximum load).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "=== sweep $(date -u +%H:%M:%S)"
timeout 200 python3 dev/bench/moe_gemv_sweep.py --formats nvfp4 --variants \
    "32,128,4,1;16,256,4,1;8,512,4,1;8,1024,4,1;4,1024,4,1;4,2048,4,1;8,1024,8,1;16,512,8,1;64,128,4,1;8,256,2,1;32,128,4,2;32,128,4,4;16,512,4,2;8,512,4,4;16,256,4,2;64,64,4,1;128,64,4,1;64,128,8,1;16,128,4,1;16,128,2,1" \
    2>&1 | tee "$OUT/nvfp4_sweep.log" | grep -E "^#|FAIL"
best=$(grep -oE "moe_gemv_config\['nvfp4'\] = \([0-9, ]+\)" "$OUT/nvfp4_sweep.log" | grep -oE "\([0-9, ]+\)")
[ -n "$best" ] || { echo "no winner"; exit 1; }
sed -i "/^ *\"int4\": ([0-9]*, [0-9]*, [0-9]*, [0-9]*), \"nvfp4\"/s/\"nvfp4\": ([0-9, ]*)/\"nvfp4\": $best/" \
    lowbit/kernels/tuning/sm90.py
grep -n '^ *"int4": (' lowbit/kernels/tuning/sm90.py
echo "=== tests $(date -u +%H:%M:%S)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_gpu.py tests/test_dummy_qwen3_moe.py \
    -k "nvfp4 and gpu" 2>&1 | tail -3
echo "=== serve $(date -u +%H:%M:%S)"
timeout 200 python3 -m lowbit.cli bench serve --model qwen3-30b-a3b --phases check,formats --formats nvfp4 \
    --deadline-s 60 --num-requests 256 --json "$OUT/moe_nvfp4.json" --markdown "$OUT/moe_nvfp4.md" 2>&1 \
    | grep -E '^\[|Error' | cut -c1-400
