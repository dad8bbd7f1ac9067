# Run 36, call 1: the selection and append kernels' tests on the GPU; then run 35's choice-from-scores
# A/B and run 34's sketch-recode A/B at 32K (each in one process), as far as the call's time allows.
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; S0=$(date +%s)
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/test_select_pages.py tests/test_kernels.py -k "select or append or sketch" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
CONTEXTS=32768 timeout 230 python benchmarks/results/2026-12-06-offline-run35/select_ab.py $OUT/select-ab-32k.json 200 > $OUT/select-ab-32k.txt 2>&1; tail -8 $OUT/select-ab-32k.txt
echo "select-ab $(( $(date +%s) - S0 )) s"
N=32768 timeout 50 python benchmarks/results/2026-12-06-h100-run34/append_sketch.py > $OUT/append-32k.txt 2>&1; tail -6 $OUT/append-32k.txt
LEFT=$(( 560 - ($(date +%s) - S0) ))
timeout $LEFT python benchmarks/results/2026-12-06-h100-run34/gen_ab.py 32768 $OUT/gen-ab-32k.json > $OUT/gen-ab-32k.txt 2>&1; tail -5 $OUT/gen-ab-32k.txt
echo "total $(( $(date +%s) - S0 )) s"
tar czf $OUT/cache.tgz .cache 2>/dev/null; ls -la $OUT/cache.tgz
