export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; S0=$(date +%s)
timeout 120 python -m pytest -q -x tests/test_community_choice.py -p no:cacheprovider > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
timeout 200 python -m benchmarks.select_bench --contexts 32768 --policies quest0.1,community-kv0.1-runs10 --out $OUT/select.json > $OUT/select.txt 2>&1
grep "n=" $OUT/select.txt | grep -v threshold; echo "select $(( $(date +%s) - S0 )) s"
timeout 150 python - > $OUT/tune.txt 2>&1 <<'PY'
import json, os, torch
from benchmarks import select_bench as sb, common
from benchmarks.probes import D, H
rows = []
states = sb.layer_copies(32768, None)
q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
sb.tune_communities(32768, rows, states, q)
for r in rows: print(r)
json.dump(rows, open(os.environ["OUT"] + "/tune.json", "w"), indent=1)
PY
grep "^tune\|Error" $OUT/tune.txt; echo "tune $(( $(date +%s) - S0 )) s"
mkdir -p $OUT/new $OUT/old
timeout 110 python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768 --out $OUT/new > $OUT/new/trace.txt 2>&1
grep "^## \|^step" $OUT/new/*.md; echo "trace new $(( $(date +%s) - S0 )) s"
LEFT=$(( 585 - ($(date +%s) - S0) ))
cd .old2 && PYTHONPATH=$PWD timeout $LEFT python -m benchmarks.trace_step --layers 8 --settings community-kv0.1-runs10@32768 --out $OUT/old > $OUT/old/trace.txt 2>&1; cd ..
grep "^## \|^step" $OUT/old/*.md; echo "total $(( $(date +%s) - S0 )) s"
