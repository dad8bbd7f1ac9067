#!/usr/bin/env bash
# Run 37, call 2: the "columns" sketch bound on the GPU: one layer against "rows" (each config checked
# against the reference), `generate` A/B with the fastest columns config at 128K, then the kernel tests.
set -uo pipefail
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
R=benchmarks/results/2026-12-07-h100-run37
timeout 150 python $R/columns-experiment.py 2>&1 | tee $OUT/call2-columns.txt
BEST=$(grep '^BEST ' $OUT/call2-columns.txt | cut -d' ' -f2)
if [ -n "$BEST" ]; then
  timeout 300 python -m benchmarks.ab --generate dense@131072,quest0.1-sketch@131072 --dynamic-capacity \
    --variant rows= --variant "columns=$BEST" --rounds 1 --out $OUT/call2-ab 2>&1 | tail -30 | tee $OUT/call2-ab.txt
fi
timeout 100 python -m pytest -q -p no:cacheprovider -x tests/test_kernels.py -k "sketch_page_bound" 2>&1 | tail -4 | tee $OUT/call2-tests.txt
