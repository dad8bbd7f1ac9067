#!/usr/bin/env bash
# Run 39, call 3: the half2 sketch kernel with one token a step and no head axis (layouts that no
# Triton version can spread over the threads): its GPU tests, its timing against "rows" on one layer
# at 32K and 128K, then one layer's selection with each at 128K (run 38's select_ab.py).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
D=benchmarks/results/2026-12-07-h100-run39
S0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/call3-gpu.txt
timeout 90 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k "half2 or sketch" > $OUT/call3-tests.txt 2>&1; tail -3 $OUT/call3-tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
timeout 150 python $D/half2-experiment.py 2>&1 | grep -v Warning | tee $OUT/call3-kernel.txt
echo "kernel $(( $(date +%s) - S0 )) s"
timeout 120 python benchmarks/results/2026-12-07-offline-run38/select_ab.py 131072 $OUT/call3-select.json > $OUT/call3-select.txt 2>&1; grep -v Warning $OUT/call3-select.txt | grep "sketch\|nominate\|done"
echo "total $(( $(date +%s) - S0 )) s"
