#!/usr/bin/env bash
# Run 43, call 1: the softmax streams chunk kernel (AttentionConfig.streams) alone against the default,
# then generate end to end (benchmarks.ab, a process a variant); the compile caches come back.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
D=benchmarks/results/2026-12-07-h100-run42
S0=$(date +%s)
timeout 170 python $D/attn_variants.py --streams 2>&1 | grep -v Warning | tee $OUT/call1-streams.txt
echo "streams $(( $(date +%s) - S0 )) s"
LEFT=$(( 540 - ($(date +%s) - S0) ))
timeout $LEFT python -m benchmarks.ab --generate quest0.1@32768,quest0.1@131072 --dynamic-capacity \
  --variant default= --variant streams4=attention.streams=4 --rounds 1 --timeout $(( LEFT / 2 - 4 )) --out $OUT/ab 2>&1 | grep -v Warning | tail -30
echo "ab $(( $(date +%s) - S0 )) s"
tar czf /tmp/cache.tgz .cache && split -b 15M /tmp/cache.tgz $OUT/cache.tgz. ; ls -la $OUT
echo "total $(( $(date +%s) - S0 )) s"
