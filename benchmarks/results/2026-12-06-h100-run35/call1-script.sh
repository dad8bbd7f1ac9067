export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
timeout 200 python -m pytest -q -x tests/test_select_pages.py tests/test_kernels.py -k "select or append" -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
echo "checks $(( $(date +%s) - S0 )) s"
LEFT=$(( 585 - ($(date +%s) - S0) ))
timeout $LEFT python -m benchmarks.sweep --deadline $((LEFT - 15)) --only select,generate --select-contexts 32768,131072 --select-policies quest0.1,quest0.1-sketch,quest0.1-nominate4 --dynamic-capacity --generate dense@131072,quest0.1-sketch@131072,quest0.1-nominate4@131072,quest0.1@131072,dense@32768,quest0.1-sketch@32768 --out /tmp/sw > $OUT/sweep.txt 2>&1
cp /tmp/sw/sweep.json $OUT/sweep.json 2>/dev/null; cp /tmp/sw/*.md $OUT/ 2>/dev/null
grep "ms/token\|select\|FAILED\|deadline\|Error" $OUT/sweep.txt | head -40
echo "total $(( $(date +%s) - S0 )) s"
