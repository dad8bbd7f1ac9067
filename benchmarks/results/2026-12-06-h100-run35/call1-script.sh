# Run 35, call 1: the kernel tests of the selection and the append on the GPU; generate with the
# choice from given scores in one launch against the previous step, in one process; then the
# append's sketch recode (run 34's change) against the previous write, if time is left.
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
timeout 100 python -m pytest -q -x tests/test_select_pages.py tests/test_kernels.py -k "select or append" -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
LEFT=$(( 330 - ($(date +%s) - S0) ))
timeout $LEFT python benchmarks/results/2026-12-06-h100-run35/select_ab.py $OUT/select-ab.json $((LEFT - 50)) > $OUT/select-ab.txt 2>&1; tail -12 $OUT/select-ab.txt
echo "select $(( $(date +%s) - S0 )) s"
LEFT=$(( 370 - ($(date +%s) - S0) ))
[ $LEFT -gt 40 ] && N=32768 timeout $LEFT python benchmarks/results/2026-12-06-h100-run34/append_sketch.py > $OUT/append-32k.txt 2>&1; tail -6 $OUT/append-32k.txt
echo "total $(( $(date +%s) - S0 )) s"
