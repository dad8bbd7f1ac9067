export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
D=benchmarks/results/2026-12-06-h100-run34
timeout 200 python $D/dot-experiment.py > $OUT/dot.txt 2>&1; tail -25 $OUT/dot.txt
