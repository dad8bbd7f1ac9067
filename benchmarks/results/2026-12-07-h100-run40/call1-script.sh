#!/usr/bin/env bash
# Run 40, call 1: the half2 kernel under register caps (registers.py), caches carried back.
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
S0=$(date +%s)
timeout 420 python benchmarks/results/2026-12-07-h100-run40/registers.py 2>&1 | grep -v Warning | tee $OUT/call1-registers.txt
echo "registers $(( $(date +%s) - S0 )) s"
tar czf $OUT/cache.tgz .cache
