export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
PYTHONPATH=$PWD timeout 330 python -m benchmarks.sweep --deadline 300 --only generate --dynamic-capacity --generate dense@32768,community-kv0.1-runs10@32768 --out /tmp/gnew > $OUT/gen-new.txt 2>&1
cp /tmp/gnew/sweep.json $OUT/gen-new.json 2>/dev/null
grep "ms/token\|FAILED\|deadline" $OUT/gen-new.txt | grep -v first; echo "new $(( $(date +%s) - S0 )) s"
LEFT=$(( 585 - ($(date +%s) - S0) ))
cd .old2 && PYTHONPATH=$PWD timeout $LEFT python -m benchmarks.sweep --deadline $((LEFT - 15)) --only generate --dynamic-capacity --generate community-kv0.1-runs10@32768 --out /tmp/gold > $OUT/gen-old.txt 2>&1; cd ..
cp /tmp/gold/sweep.json $OUT/gen-old.json 2>/dev/null
grep "ms/token\|FAILED\|deadline" $OUT/gen-old.txt | grep -v first; echo "total $(( $(date +%s) - S0 )) s"
