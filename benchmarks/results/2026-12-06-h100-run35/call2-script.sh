# The previous tree (33108fe, in .old2) for the same generate settings, then the append A/B.
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
LEFT=$(( 400 - ($(date +%s) - S0) ))
(cd .old2 && PYTHONPATH=$PWD timeout $LEFT python -m benchmarks.sweep --deadline $((LEFT - 15)) --only select,generate --select-contexts 32768,131072 --select-policies quest0.1-sketch,quest0.1-nominate4 --dynamic-capacity --generate dense@131072,quest0.1-sketch@131072,quest0.1-nominate4@131072,dense@32768,quest0.1-sketch@32768 --out /tmp/sw-old > $OUT/sweep-old.txt 2>&1)
cp /tmp/sw-old/sweep.json $OUT/sweep-old.json 2>/dev/null; cp /tmp/sw-old/sweep.md $OUT/sweep-old.md 2>/dev/null
grep "ms/token\|select\|FAILED\|deadline\|Error" $OUT/sweep-old.txt | head -30
echo "old $(( $(date +%s) - S0 )) s"
export PYTHONPATH=$PWD
N=32768 timeout 60 python benchmarks/results/2026-12-06-h100-run34/append_sketch.py > $OUT/append-32k.txt 2>&1; tail -6 $OUT/append-32k.txt
LEFT=$(( 585 - ($(date +%s) - S0) ))
timeout $LEFT python benchmarks/results/2026-12-06-h100-run34/gen_ab.py 32768 $OUT/gen-ab-32k.json > $OUT/gen-ab-32k.txt 2>&1; tail -5 $OUT/gen-ab-32k.txt
echo "total $(( $(date +%s) - S0 )) s"
