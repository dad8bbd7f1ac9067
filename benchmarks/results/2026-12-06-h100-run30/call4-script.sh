export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
timeout 400 python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768,community-kv0.1-runs10-whole@32768,dense-gemv@4096,dense@4096 --out $OUT > $OUT/trace.txt 2>&1
grep "^## " $OUT/*.md; tail -3 $OUT/trace.txt; echo "total $(( $(date +%s) - S0 )) s"
