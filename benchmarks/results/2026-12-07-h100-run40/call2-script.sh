#!/usr/bin/env bash
# Run 40, call 2: attention over a tenth of the pages, placed differently (locality.py).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
S0=$(date +%s)
timeout 300 python benchmarks/results/2026-12-07-h100-run40/locality.py 131072 2>&1 | grep -v Warning | tee $OUT/call2-locality.txt
echo "total $(( $(date +%s) - S0 )) s"
