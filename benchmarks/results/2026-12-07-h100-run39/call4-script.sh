#!/usr/bin/env bash
# Run 39, call 4: generate at 128K with Quest(0.1, bound="sketch"), "rows" against "half2" (run 38's gen_ab.py).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
timeout 540 python benchmarks/results/2026-12-07-offline-run38/gen_ab.py 131072 quest0.1-sketch $OUT/call4-generate.json 2>&1 | grep -v Warning | tee $OUT/call4-generate.txt | tail -8
