# Run 35, call 1: the selection kernels' tests on the GPU; generate at 32K with the choice from given
# scores in one launch against the previous step, in one process (as much as the time allows).
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
timeout 60 python -m pytest -q -x tests/test_select_pages.py -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
LEFT=$(( 185 - ($(date +%s) - S0) ))
CONTEXTS=32768 timeout $LEFT python benchmarks/results/2026-12-06-offline-run35/select_ab.py $OUT/select-ab.json $((LEFT - 25)) > $OUT/select-ab.txt 2>&1; tail -8 $OUT/select-ab.txt
echo "total $(( $(date +%s) - S0 )) s"
