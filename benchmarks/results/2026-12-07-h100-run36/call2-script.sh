# Run 36, call 2 (the cache append's recode reverted): the rest of the selection kernels' tests on the
# GPU, then run 35's choice-from-scores A/B at 128K (dense first), as far as the call's time allows.
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; S0=$(date +%s)
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/test_select_pages.py::test_policies_choose_what_their_steps_choose tests/test_kernels.py -k "sketch_page_bound or cache_append or policies_choose" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
LEFT=$(( 320 - ($(date +%s) - S0) ))
CONTEXTS=131072 timeout $LEFT python benchmarks/results/2026-12-06-offline-run35/select_ab.py $OUT/select-ab-128k.json $((LEFT - 45)) > $OUT/select-ab-128k.txt 2>&1; tail -8 $OUT/select-ab-128k.txt
echo "total $(( $(date +%s) - S0 )) s"
