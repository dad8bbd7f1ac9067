#!/usr/bin/env bash
# Run 40, call 1: the half2 kernel under register caps (registers.py); then, if a cap is at least 3%
# faster at 128K and correct, generate at 128K with it against no cap (gen_caps.py).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
D=benchmarks/results/2026-12-07-h100-run40
S0=$(date +%s)
timeout 220 python $D/registers.py 0,200,184 131072,32768 $OUT/call1-registers.json 2>&1 | grep -v Warning | tee $OUT/call1-registers.txt
echo "registers $(( $(date +%s) - S0 )) s"
CAP=$(python - <<'PY'
import json, os
r = [x for x in json.load(open(os.environ["OUT"] + "/call1-registers.json")) if x["context"] == 131072 and x["method"] == "half2" and x["check"] == "ok"]
base = [x["us"] for x in r if x["max_registers"] == 0]
best = min(r, key=lambda x: x["us"], default=None)
print(best["max_registers"] if base and best and best["max_registers"] and best["us"] < 0.97 * base[0] else 0)
PY
)
echo "cap for generate: $CAP"
if [ "$CAP" != "0" ]; then
  timeout 330 python $D/gen_caps.py 131072 quest0.1-sketch $CAP $OUT/call1-generate.json 2>&1 | grep -v Warning | tee $OUT/call1-generate.txt | tail -6
fi
echo "total $(( $(date +%s) - S0 )) s"
tar czf $OUT/cache.tgz .cache
