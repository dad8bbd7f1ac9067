#!/usr/bin/env bash
# Run 37, call 1: where the key-sketch bound's time goes at 128K (layout-experiment.py).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
R=benchmarks/results/2026-12-07-h100-run37
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/call1-gpu.txt
timeout 420 python $R/layout-experiment.py 2>&1 | grep -v RuntimeWarning | grep -v "output = op" | tee $OUT/call1-layout.txt
