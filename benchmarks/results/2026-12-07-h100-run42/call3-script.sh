#!/usr/bin/env bash
# Run 42, call 3: EntmaxKV(0.1) at 128K with the page mean and std kept in the cache's dtype (bf16)
# against fp32, generate end to end: new (with dense), then old, one process each.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
nvidia-smi --query-gpu=name --format=csv,noheader
S0=$(date +%s)
gen() {  # label settings
  timeout 115 python -m benchmarks.sweep --only generate --dynamic-capacity --generate $2 --out /tmp/gen-$1 2>&1 \
    | grep -v Warning > $OUT/call3-$1.txt
  cp /tmp/gen-$1/sweep.json $OUT/call3-$1.json 2>/dev/null
  grep "ms/token" $OUT/call3-$1.txt | grep -v first | sed "s/^/$1: /"
  echo "$1 done at $(( $(date +%s) - S0 )) s"
}
gen bf16-a dense@131072,entmax-kv0.1@131072
cp .old/cache_fp32_moments.py policyzoo/cache.py
gen fp32 entmax-kv0.1@131072
echo "total $(( $(date +%s) - S0 )) s"
