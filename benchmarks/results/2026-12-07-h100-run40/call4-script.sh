#!/usr/bin/env bash
# Run 40, call 4: the half2 token loop in runtime steps of 16 / 8 / 4 tokens (tokens.py), an empty Triton cache.
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton-fresh TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
S0=$(date +%s)
timeout 300 python benchmarks/results/2026-12-07-h100-run40/tokens.py 16,8,4 131072,32768 2>&1 | grep -v Warning | tee $OUT/call4-tokens.txt
echo "total $(( $(date +%s) - S0 )) s"
