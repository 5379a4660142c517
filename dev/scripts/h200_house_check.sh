#!/bin/bash
# The house issue's GPU checks, two device calls (run from the repository root on the GPU machine):
#   bash dev/scripts/h200_house_check.sh ckpts CHUNK_DIR  # real checkpoints (ckpt_pack chunks): held-out ppl through
#                                                          # the kernels, then the engine-vs-reference check of every format
#   bash dev/scripts/h200_house_check.sh serve            # lowbit bench serve: fp8 and int4_awq, batch 1 and maximum load
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-out}
mkdir -p "$OUT"
case "${1:-}" in
ckpts)
    python3 dev/scripts/ckpt_pack_copy.py unpack "$2" /tmp/ck > /dev/null
    timeout 150 python3 dev/scripts/serving_ppl.py ppl dev/scripts/heldout_tokens.json /tmp/ck/smollm2-135m-fp8 \
        /tmp/ck/smollm2-135m-w8a8_sq /tmp/ck/smollm2-135m-int4_awq /tmp/ck/smollm2-135m-nvfp4 --device cuda \
        --dtype bfloat16 2>&1 | grep '^{\|Error' | tee "$OUT/real_ckpt_ppl.jsonl"
    timeout 330 python3 -m lowbit.cli bench serve --phases check --formats bf16,fp8,int4_awq,nvfp4,w8a8_sq \
        --json "$OUT/check.json" 2>&1 | grep -E '^\[|Error|FAIL' | cut -c1-600
    ;;
serve)
    timeout 500 python3 -m lowbit.cli bench serve --formats fp8,int4_awq --phases formats --max-batch-size 1024 --deadline-s 400 \
        --json "$OUT/serve.json" --markdown "$OUT/serve.md" 2>&1 | grep -E '^\[|Error' | cut -c1-700
    ;;
esac
