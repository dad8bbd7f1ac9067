#!/usr/bin/env bash
# Run 40, call 3: attention over a tenth of the pages with small tiles and deep pipelining (stages.py).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
S0=$(date +%s)
timeout 300 python benchmarks/results/2026-12-07-h100-run40/stages.py 2>&1 | grep -v Warning | tee $OUT/call3-stages.txt
echo "total $(( $(date +%s) - S0 )) s"
