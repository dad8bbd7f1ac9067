#!/usr/bin/env bash
# Run 41, call 1: run 40's token-step timing (tokens.py, an empty Triton cache for its kernels), then a
# per-kernel trace of 8-layer steps at 128K for EntmaxKV(0.1), Quest(0.1, sketch, nominate=4) and
# Quest(0.1, sketch): where the selections beyond the box spend their time.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
S0=$(date +%s)
TRITON_CACHE_DIR=$PWD/.cache/triton-fresh timeout 260 python benchmarks/results/2026-12-07-h100-run40/tokens.py 16,8,4 131072,32768 2>&1 | grep -v Warning | tee $OUT/call1-tokens.txt
echo "tokens $(( $(date +%s) - S0 )) s"
export TRITON_CACHE_DIR=$PWD/.cache/triton
timeout 300 python -m benchmarks.trace_step --layers 8 --steps 5 --settings entmax-kv0.1@131072,quest0.1-nominate4@131072,quest0.1-sketch@131072 --out $OUT/trace 2>&1 | grep -v Warning | tail -40
echo "total $(( $(date +%s) - S0 )) s"
rm -rf .cache/triton-fresh
tar czf $OUT/cache.tgz .cache
