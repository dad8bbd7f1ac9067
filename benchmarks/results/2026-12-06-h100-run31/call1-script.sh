export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
PYTHONPATH=$PWD timeout 150 python -m pytest -q -x tests/test_community_choice.py tests/test_communitykv.py -k "not worker and not leidenalg" -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
echo "tests took $(( $(date +%s) - S0 )) s"
mkdir -p $OUT/new $OUT/old
PYTHONPATH=$PWD timeout 150 python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768 --out $OUT/new > $OUT/new/trace.txt 2>&1
echo "new took $(( $(date +%s) - S0 )) s"; grep "^## \|^step" $OUT/new/*.md; tail -3 $OUT/new/trace.txt
cd .old2 && PYTHONPATH=$PWD timeout 150 python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768 --out $OUT/old > $OUT/old/trace.txt 2>&1; cd ..
grep "^## \|^step" $OUT/old/*.md; echo "traces done $(( $(date +%s) - S0 )) s"
LEFT=$(( 585 - ($(date +%s) - S0) ))
PYTHONPATH=$PWD timeout $LEFT python -m benchmarks.sweep --deadline $((LEFT - 20)) --only generate --dynamic-capacity --generate dense@32768,community-kv0.1-runs10@32768 --out /tmp/comm > $OUT/comm.txt 2>&1
cp /tmp/comm/sweep.json $OUT/comm.json 2>/dev/null
grep "ms/token\|FAILED\|deadline" $OUT/comm.txt | grep -v first; echo "total $(( $(date +%s) - S0 )) s"
