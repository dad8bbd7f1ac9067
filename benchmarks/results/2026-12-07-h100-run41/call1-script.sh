#!/usr/bin/env bash
# Run 41, call 1: EntmaxKV's threshold in float32 steps alone (threshold.py, generate at 128K against
# the float64 steps and dense, the kernel's GPU tests), then run 40's token-step
# timing (tokens.py, an empty Triton cache for its kernels) in the time left.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
D=benchmarks/results/2026-12-07-h100-run41
S0=$(date +%s)
timeout 90 python $D/threshold.py 2>&1 | grep -v Warning | tee $OUT/call1-threshold.txt
echo "threshold $(( $(date +%s) - S0 )) s"
timeout 300 python -m benchmarks.sweep --only generate --dynamic-capacity \
  --generate dense@131072,entmax-kv0.1@131072,entmax-kv0.1-f64@131072 --out /tmp/gen 2>&1 | grep -v Warning > $OUT/call1-generate.txt
cp /tmp/gen/sweep.json $OUT/call1-generate.json 2>/dev/null; grep "ms/token" $OUT/call1-generate.txt | grep -v first
echo "generate $(( $(date +%s) - S0 )) s"
timeout 80 python -m pytest tests/test_entmax.py -q -x -k threshold -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/call1-tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
LEFT=$(( 575 - ($(date +%s) - S0) ))
if [ $LEFT -gt 60 ]; then
  TRITON_CACHE_DIR=$PWD/.cache/triton-fresh timeout $LEFT python benchmarks/results/2026-12-07-h100-run40/tokens.py 16,8,4 131072,32768 2>&1 | grep -v Warning | tee $OUT/call1-tokens.txt
fi
echo "total $(( $(date +%s) - S0 )) s"
rm -rf .cache/triton-fresh
tar czf $OUT/cache.tgz .cache
