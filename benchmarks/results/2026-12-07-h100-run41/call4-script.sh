#!/usr/bin/env bash
# Run 41, call 4: the threshold kernel's tests on the GPU (tests/test_entmax.py no longer needs the
# `entmax` package to collect), and the walked path (16,388 pages, a 256K cache) in threshold.py.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
S0=$(date +%s)
timeout 50 python benchmarks/results/2026-12-07-h100-run41/threshold.py 16388 2>&1 | grep -v Warning | tee $OUT/call4-threshold.txt
timeout 150 python -m pytest tests/test_entmax.py -q -k threshold_kernel -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/call4-tests.txt
echo "total $(( $(date +%s) - S0 )) s"
