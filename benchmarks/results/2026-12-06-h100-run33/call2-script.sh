export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
(cd .new2 && PYTHONPATH=$PWD timeout 100 python -m pytest -q -x tests/test_community_choice.py -p no:cacheprovider > $OUT/tests-community.txt 2>&1); tail -2 $OUT/tests-community.txt
echo "tests community $(( $(date +%s) - S0 )) s"
LEFT=$(( 580 - ($(date +%s) - S0) )); H=$(( LEFT / 2 ))
(cd .new2 && PYTHONPATH=$PWD timeout $H python -m benchmarks.select_bench --contexts 32768 --policies quest0.1,community-kv0.1-runs10 --out $OUT/select-new.json > $OUT/select-new.txt 2>&1)
grep "n=" $OUT/select-new.txt | grep -v threshold; echo "select new $(( $(date +%s) - S0 )) s"
LEFT=$(( 585 - ($(date +%s) - S0) ))
PYTHONPATH=$PWD timeout $LEFT python -m benchmarks.select_bench --contexts 32768 --policies quest0.1,community-kv0.1-runs10 --out $OUT/select-old.json > $OUT/select-old.txt 2>&1
grep "n=" $OUT/select-old.txt | grep -v threshold; echo "total $(( $(date +%s) - S0 )) s"
