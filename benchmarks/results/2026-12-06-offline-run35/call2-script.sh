# Run 35, call 2: the sketch recode in the append (run 34's change) against the previous write, the
# append alone and generate at 32K in one process; then the previous tree's generate again (order).
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
export PYTHONPATH=$PWD
N=32768 timeout 60 python benchmarks/results/2026-12-06-h100-run34/append_sketch.py > $OUT/append-32k.txt 2>&1; tail -6 $OUT/append-32k.txt
timeout 300 python benchmarks/results/2026-12-06-h100-run34/gen_ab.py 32768 $OUT/gen-ab-32k.json > $OUT/gen-ab-32k.txt 2>&1; tail -5 $OUT/gen-ab-32k.txt
echo "total $(( $(date +%s) - S0 )) s"
