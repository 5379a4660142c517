#!/bin/bash
# Second-wave GPU checks, run from the repository root on the GPU machine with `.gpu` carried (wheels the machine
# lacks: xgrammar and its pydantic, jsonschema, pytest; a store with the embedded model's tokenizer only):
#   bash dev/scripts/h200_wave2.sh offload      # lowbit bench serve-prefix: TTFT of an evicted 8k prefix, host cache off/on
#   bash dev/scripts/h200_wave2.sh tests        # the GPU tests: kernels + graphs vs the reference path, structured output
#   bash dev/scripts/h200_wave2.sh spec         # lowbit bench spec: verify-step cost for k drafted tokens, batch-1 n-gram tok/s
#   bash dev/scripts/h200_wave2.sh window       # window/softcap kernels vs references, windowed decode timed
#   bash dev/scripts/h200_wave2.sh checks       # window/softcap kernels; engine check on Gemma-3 and Mistral shapes; interop layouts
#   bash dev/scripts/h200_wave2.sh families     # lowbit bench serve: Gemma-3-12B and Llama-3.1-8B shapes, FP8, batch 1 and max load
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LOWBIT_HOME=$PWD/.gpu/home OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps .gpu/wheels/*.whl 2>&1 | grep -v "as the .root. user" | tail -2  # the python that runs, not the system pip
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for step in "$@"; do
case "$step" in
offload)
    timeout 300 python3 -m lowbit.cli bench serve-prefix --repeats 3 --json "$OUT/prefix.jsonl" 2>&1 | grep -v '^\[lowbit\]' | tail -30
    ;;
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine_dummy.py tests/test_gpu_engine_graphs.py \
        tests/test_serve_structured.py -k "gpu or graphs or reference_path" 2>&1 | tail -25
    ;;
window)
    timeout 150 python3 dev/scripts/window_attention_check.py 2>&1 | tail -40
    ;;
checks)
    for m in ${CHECK_MODELS:-gemma-3-12b mistral-7b}; do
        timeout 200 python3 -m lowbit.cli bench serve --model $m --phases check --formats fp8,int4_awq \
            --json "$OUT/check_$m.json" 2>&1 | grep -E '^\[|Error|FAIL|PASS' | cut -c1-400
    done
    timeout 150 python3 dev/bench/interop_layouts.py --layers 4 --osl 128 2>&1 | tail -15
    ;;
families)
    for m in gemma-3-12b llama-3.1-8b; do
        timeout 200 python3 -m lowbit.cli bench serve --model $m --phases formats --formats fp8 --deadline-s 150 \
            --num-requests ${NUM_REQUESTS:-1024} \
            --json "$OUT/serve_$m.json" --markdown "$OUT/serve_$m.md" 2>&1 | grep -E '^\[|Error' | cut -c1-500
    done
    ;;
spec)
    timeout 240 python3 -m lowbit.cli bench spec --batch-sizes 1,4,16,32,64 --ks 1,2,4,8 --repeats 10 \
        --json "$OUT/spec.jsonl" 2>&1 | grep -v '^\[lowbit\]' | tail -20
    ;;
esac
done
