#!/bin/bash
# Second-wave GPU checks, part 2, run from the repository root on the GPU machine with `.gpu` carried (wheels the
# machine lacks, a store with the embedded model's tokenizer, ckpt_pack.py) and the embedded model's fp8 and
# int4_awq checkpoints reassembled from chunks under /tmp/ck (ckpt_pack.py pack, one chunk carried per call):
#   bash dev/scripts/h200_wave2b.sh unpack    # /tmp/ck -> .gpu/home/models/{smollm2-135m-fp8,smollm2-135m-int4_awq}
#   bash dev/scripts/h200_wave2b.sh tests     # verify-step graphs, KV pools per layer kind, window, engine graphs
#   bash dev/scripts/h200_wave2b.sh spec      # lowbit bench spec: verify cost (graphed/eager), tok/s with/without
#   bash dev/scripts/h200_wave2b.sh specreal  # lowbit bench spec on the real fp8 checkpoint, int4_awq drafting
#   bash dev/scripts/h200_wave2b.sh specreal2 # n-gram on the real fp8 checkpoint: quote + chat, k = 8 (default), 4, 16
#   bash dev/scripts/h200_wave2b.sh specoff   # the same at batch 1/4/16/64 with the measured auto-off policy
#   bash dev/scripts/h200_wave2b.sh speccap   # batch 32 and 64 under the engine's default speculative_max_batch_size
#   bash dev/scripts/h200_wave2b.sh spectests # the policy's tests and the verify-graph GPU tests
#   bash dev/scripts/h200_wave2b.sh moediag   # the w8a8_sq (and fp8) Qwen3-MoE graphs check, with its numbers
#   bash dev/scripts/h200_wave2b.sh interop   # W4 layouts (modelopt, compressed-tensors, GPTQ, AutoAWQ) batch-1 tok/s
#   bash dev/scripts/h200_wave2b.sh gemma     # Gemma-3-12B shapes (two KV pools): engine check + serve figures
#   bash dev/scripts/h200_wave2b.sh int8dyn   # INT8 per-token dynamic vs w8a8_sq: engine check + serve figures
#   bash dev/scripts/h200_wave2b.sh moe       # MoE GPU tests, fused-vs-loop kernel bench, Qwen3-30B-A3B serve
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LOWBIT_HOME=$PWD/.gpu/home OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps .gpu/wheels/*.whl 2>&1 | grep -v "as the .root. user" | tail -2
lb() { local t=$1; shift; timeout "$t" python3 -m lowbit.cli "$@" 2>&1 | grep -v '^\[lowbit\]'; }  # lb SECONDS ARGS
for step in "$@"; do
echo "=== $step $(date -u +%H:%M:%S)"
case "$step" in
unpack)
    python3 .gpu/ckpt_pack.py unpack /tmp/ck .gpu/home/models && ls .gpu/home/models
    ;;
tests)
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec_verify_graphs.py \
        tests/test_kernels_decode_inputs.py tests/test_serve_kv_kinds.py tests/test_gpu_engine_graphs.py \
        tests/test_serve_window.py 2>&1 | tail -25
    ;;
spec)
    lb 300 bench spec --batch-sizes 1,16,64 --ks 1,2,4,8 --tps-batch-sizes 1,16,64 --repeats 5 \
        --json "$OUT/spec_8b.jsonl" | tail -40
    ;;
specreal)
    lb 200 bench spec --model smollm2-135m-fp8 --draft-model smollm2-135m-int4_awq --no-verify-table \
        --tps-batch-sizes 1,4,16,64 --json "$OUT/spec_real.jsonl" | tail -25
    ;;
specreal2)
    lb 400 bench spec --model smollm2-135m-fp8 --batch1-only --tps-batch-sizes 1,4,16 \
        --json "$OUT/spec_real2.jsonl" | grep -v '^{' | tail -24
    for k in 4 16; do
        lb 200 bench spec --model smollm2-135m-fp8 --batch1-only --tps-batch-sizes 1 --num-draft-tokens $k \
            --json "$OUT/spec_real2_k$k.jsonl" | grep -v '^{' | tail -12
    done
    ;;
specoff)
    lb 330 bench spec --model smollm2-135m-fp8 --batch1-only --tps-batch-sizes 1,4,16,64 \
        --json "$OUT/spec_off.jsonl" | grep -v '^{' | tail -40
    ;;
speccap)  # the engine's own auto-off batch size (16) at batch 32 and 64
    lb 200 bench spec --model smollm2-135m-fp8 --batch1-only --tps-batch-sizes 32,64 --speculative-max-batch-size 16 \
        --json "$OUT/spec_cap.jsonl" | grep -v '^{' | tail -16
    ;;
spectests)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_spec_policy.py \
        tests/test_gpu_spec_verify_graphs.py 2>&1 | tail -5
    ;;
moediag)  # the w8a8_sq Qwen3-MoE graphs check with its numbers (and fp8's beside it)
    timeout 120 python3 - <<'PY' 2>&1 | grep -v '^\[lowbit\]'
import json
from lowbit.bench import serve_bench as b
for fmt in ("w8a8_sq", "fp8"):
    r = b.check_format(b.parse(["--check-layers", "2", "--model", "qwen3-30b-a3b", "--phases", "check"]), fmt)
    print(fmt, json.dumps({k: v for k, v in r.items() if not isinstance(v, list) or len(v) < 8}))
PY
    ;;
interop)
    lb 240 bench serve --model llama-3.1-8b --phases interop --max-batch-size 8 --json "$OUT/interop.json" \
        --markdown "$OUT/interop.md" | grep -E '^\[|Error' | cut -c1-400
    ;;
gemma)
    lb 240 bench serve --model gemma-3-12b --phases check,formats --formats fp8 --deadline-s 90 \
        --num-requests 512 --json "$OUT/gemma.json" --markdown "$OUT/gemma.md" | grep -E '^\[|Error' | cut -c1-500
    ;;
int8dyn)
    lb 240 bench serve --model llama-3.1-8b --phases check,formats --formats int8_dynamic,w8a8_sq \
        --deadline-s 60 --num-requests 512 --json "$OUT/int8dyn.json" --markdown "$OUT/int8dyn.md" \
        | grep -E '^\[|Error' | cut -c1-500
    ;;
moe)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_dummy_qwen3_moe.py tests/test_kernels_moe_gpu.py -k gpu 2>&1 | tail -8
    timeout 150 python3 dev/bench/moe_kernel.py --formats bf16 fp8 fp8_pt int4 --batches 1 2 4 8 16 64 256 2>&1 | tail -45
    lb 240 bench serve --model qwen3-30b-a3b --phases check,formats --formats bf16,fp8,int4_awq \
        --deadline-s 60 --num-requests 256 --json "$OUT/moe.json" --markdown "$OUT/moe.md" | grep -E '^\[|Error' | cut -c1-500
    ;;
esac
done
