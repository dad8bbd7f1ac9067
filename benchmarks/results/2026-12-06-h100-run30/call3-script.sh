export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
timeout 420 python -m benchmarks.sweep --only generate --dynamic-capacity --generate community-kv0.1-runs10-whole@32768,community-kv0.1-runs10@32768,dense@32768 --out /tmp/comm > $OUT/comm.txt 2>&1
cp /tmp/comm/sweep.json $OUT/comm.json 2>/dev/null
grep "ms/token\|FAILED" $OUT/comm.txt | grep -v first; echo "community took $(( $(date +%s) - S0 )) s"
