#!/usr/bin/env bash
# Run 38, call 2 (the last device minutes): the half2 kernel against "rows" on one 128K layer only.
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/call2-gpu.txt
timeout 110 python benchmarks/results/2026-12-07-offline-run38/half2-experiment.py 131072 2>&1 | grep -v Warning | tee $OUT/call2-kernel.txt
