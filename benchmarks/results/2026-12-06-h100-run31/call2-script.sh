export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
cd .old2 && PYTHONPATH=$PWD timeout 200 python -m benchmarks.sweep --deadline 150 --only generate --dynamic-capacity --generate dense@32768,community-kv0.1-runs10@32768 --out /tmp/old > $OUT/old.txt 2>&1; cd ..
cp /tmp/old/sweep.json $OUT/old.json 2>/dev/null; grep "ms/token" $OUT/old.txt; echo "old $(( $(date +%s) - S0 )) s"
LEFT=$(( 380 - ($(date +%s) - S0) ))
PYTHONPATH=$PWD timeout $LEFT python -m benchmarks.sweep --deadline $((LEFT - 100)) --only generate --dynamic-capacity --generate community-kv0.1-runs10@32768,dense@32768 --out /tmp/new > $OUT/new.txt 2>&1
cp /tmp/new/sweep.json $OUT/new.json 2>/dev/null; grep "ms/token" $OUT/new.txt; echo "total $(( $(date +%s) - S0 )) s"
