#!/bin/bash
# lm-eval task recovery (candidate / float baseline, each +- se) of every shipped recipe on the embedded model, for
# docs/accuracy.md: quantize each recipe into $DIR (fp8 from the store), then
# `lowbit eval CKPT --tasks arc_easy,hellaswag,piqa --limit $LIMIT --no-gate --report $DIR/R.json`.
#   OMP_NUM_THREADS=1 [RECIPES="nvfp4 ..."] bash dev/scripts/task_recovery.sh [DIR] [LIMIT]
set -u
DIR=${1:-/tmp/recovery}
LIMIT=${2:-200}
mkdir -p "$DIR"
for r in ${RECIPES:-fp8 w8a8_sq fp8_dynamic nvfp4 int4_rtn int4_awq}; do
    echo "=== $r $(date -u +%H:%M:%S)"
    ck="$DIR/$r"
    [ "$r" = fp8 ] && ck=smollm2-135m-fp8
    if [ "$r" != fp8 ] && [ ! -d "$ck" ]; then
        /usr/bin/time -f "quantize %e s" python3 -m lowbit.cli quantize --recipe "$r" smollm2-135m -o "$ck" 2>&1 \
            | grep -E "quantize|rror" | tail -2
    fi
    /usr/bin/time -f "eval %e s" python3 -m lowbit.cli eval "$ck" --tasks arc_easy,hellaswag,piqa --limit "$LIMIT" \
        --no-gate --report "$DIR/$r.json" 2>&1 | grep -vE "^\[lowbit\]|it/s\]|s/it\]" | tail -12
done
