#!/bin/bash
# Second-wave GPU checks, run from the repository root on the GPU machine with `.gpu` carried (wheels the machine
# lacks: xgrammar and its pydantic, jsonschema, pytest; a store with the embedded model's tokenizer only):
#   bash dev/scripts/h200_wave2.sh offload      # lowbit bench serve-prefix: TTFT of an evicted 8k prefix, host cache off/on
#   bash dev/scripts/h200_wave2.sh tests        # the GPU tests: kernels + graphs vs the reference path, structured output
#   bash dev/scripts/h200_wave2.sh families     # model families: engine check and serve figures (after issue 33 lands)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD LOWBIT_HOME=$PWD/.gpu/home OMP_NUM_THREADS=8
OUT=${OUT:-out}
mkdir -p "$OUT"
pip install -q --no-deps .gpu/wheels/*.whl 2>&1 | tail -2
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
esac
done
