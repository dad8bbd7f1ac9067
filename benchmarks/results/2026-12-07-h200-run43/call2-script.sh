#!/usr/bin/env bash
# Run 43, call 2: EntmaxKV(0.1) at 128K with the page mean and std in the cache's dtype (bf16, the
# library's) against fp32 (the cache before cbde196), generate end to end, a process each.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
S0=$(date +%s)
gen() {  # label timeout settings
  timeout $2 python -m benchmarks.sweep --only generate --dynamic-capacity --generate $3 --out /tmp/gen-$1 2>&1 \
    | grep -v Warning > $OUT/call2-$1.txt
  cp /tmp/gen-$1/sweep.json $OUT/call2-$1.json 2>/dev/null
  grep "ms/token" $OUT/call2-$1.txt | grep -v first | sed "s/^/$1: /"
  echo "$1 done at $(( $(date +%s) - S0 )) s"
}
gen bf16 310 dense@131072,entmax-kv0.1@131072
cp .old/cache_fp32_moments.py policyzoo/cache.py
gen fp32 $(( 580 - ($(date +%s) - S0) )) entmax-kv0.1@131072
git checkout policyzoo/cache.py
echo "total $(( $(date +%s) - S0 )) s"
