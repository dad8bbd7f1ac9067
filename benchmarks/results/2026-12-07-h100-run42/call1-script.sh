#!/usr/bin/env bash
# Run 42, call 1: attention over a selection under AttentionConfig.loads (attn_variants.py), then
# generate end to end with the best setting of each loads value (benchmarks.ab, a process a variant).
# Ran at commit 43d11b0, whose AttentionConfig had the `loads` field that the ab variants set (since removed).
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
D=benchmarks/results/2026-12-07-h100-run42
S0=$(date +%s)
timeout 190 python $D/attn_variants.py $OUT/call1-variants.json 2>&1 | grep -v Warning | tee $OUT/call1-variants.txt
echo "variants $(( $(date +%s) - S0 )) s"
VARIANTS=$(python $D/attn_variants.py --best $OUT/call1-variants.json)
echo "ab variants: $VARIANTS"
LEFT=$(( 585 - ($(date +%s) - S0) ))
timeout $LEFT python -m benchmarks.ab --generate dense@4096,quest0.1@32768,quest0.1@131072 --dynamic-capacity \
  --variant after= $VARIANTS --rounds 1 --timeout $(( LEFT / 3 - 4 )) --out $OUT/ab 2>&1 | grep -v Warning | tail -30
echo "total $(( $(date +%s) - S0 )) s"
