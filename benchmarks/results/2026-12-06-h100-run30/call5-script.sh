export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
mkdir -p $OUT/new $OUT/old
PYTHONPATH=$PWD timeout 120 python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768 --out $OUT/new > $OUT/new/trace.txt 2>&1
echo "new took $(( $(date +%s) - S0 )) s"; grep "^## \|^step" $OUT/new/*.md
cd .old2 && PYTHONPATH=$PWD timeout 120 python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768 --out $OUT/old > $OUT/old/trace.txt 2>&1; cd ..
grep "^## \|^step" $OUT/old/*.md; echo "total $(( $(date +%s) - S0 )) s"
tail -3 $OUT/new/trace.txt
