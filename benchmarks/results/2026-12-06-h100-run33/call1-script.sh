export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
timeout 60 python benchmarks/results/2026-12-06-h100-run33/call1-check-rows.py > $OUT/check-rows.txt 2>&1; tail -3 $OUT/check-rows.txt
timeout 120 python -m pytest -q -x tests/test_kernels.py -k sketch -p no:cacheprovider > $OUT/tests-sketch.txt 2>&1; tail -2 $OUT/tests-sketch.txt
echo "checks $(( $(date +%s) - S0 )) s"
LEFT=$(( 580 - ($(date +%s) - S0) ))
timeout $LEFT python -m benchmarks.sweep --deadline $((LEFT - 20)) --only variants,select,generate --variants sketch_bound --select-contexts 32768,131072 --select-policies quest0.1,quest0.1-sketch,quest0.1-nominate4 --dynamic-capacity --generate dense@131072,quest0.1-sketch@131072,quest0.1-nominate4@131072,dense@32768,quest0.1-sketch@32768 --out /tmp/sw > $OUT/sweep.txt 2>&1
cp /tmp/sw/sweep.json $OUT/sweep.json 2>/dev/null; cp /tmp/sw/*.md $OUT/ 2>/dev/null
grep -i "sketch bound" $OUT/sweep.txt | sort -k9 -n | head -25; grep -i "sketch bound.*chose" $OUT/sweep.txt; grep "ms/token\|select\|FAILED\|deadline" $OUT/sweep.txt | grep -v "^variants" | head -40
echo "total $(( $(date +%s) - S0 )) s"
