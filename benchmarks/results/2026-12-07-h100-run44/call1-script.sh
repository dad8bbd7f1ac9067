#!/usr/bin/env bash
# Run 44, one call: the gate re-calibrated on this GPU (issue 38 item 7: Quest(0.2) + Threshold(0.5),
# contexts 1K-128K), then the composition at 32K beside Quest(0.2) alone and dense (generate end to
# end, dynamic capacity); the compile caches come back.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .cache ] || tar xzf .old/cache-h200.tgz
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
git log --oneline -1
S0=$(date +%s)
timeout 400 python -m benchmarks.gate_bench --out $OUT/gate --proj threshold:0.5 --no-progress \
  --calib-contexts 1k,8k,32k,128k --request-contexts 1k,4k,16k,32k,64k,128k 2>&1 | grep -v Warning > $OUT/call1-gate.txt
tail -40 $OUT/call1-gate.txt
echo "gate $(( $(date +%s) - S0 )) s"
timeout $(( 560 - ($(date +%s) - S0) )) python -m benchmarks.sweep --only generate --dynamic-capacity \
  --generate dense@32768,threshold0.5+quest0.2@32768,quest0.2@32768 --out /tmp/gen-comp 2>&1 | grep -v Warning > $OUT/call1-comp.txt
cp /tmp/gen-comp/sweep.json $OUT/call1-comp.json 2>/dev/null
grep "ms/token" $OUT/call1-comp.txt | grep -v first
echo "comp $(( $(date +%s) - S0 )) s"
tar czf /tmp/cache.tgz .cache && split -b 15M /tmp/cache.tgz $OUT/cache.tgz. ; ls -la $OUT $OUT/gate
echo "total $(( $(date +%s) - S0 )) s"
