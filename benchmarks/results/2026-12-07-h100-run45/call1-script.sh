#!/usr/bin/env bash
# Run 45, call 1: the sparse GEMV over compacted slices (GemvConfig.compact) against the plain scan,
# per 8B projection group at batch 1 (gemvfused probe), then end to end (Threshold(0.5) at 4K, A/B in
# processes of their own), then the per-launch trace of the composition at 32K. Caches come back.
set -uo pipefail
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .cache ] || tar xzf .old/cache-sm90.tgz
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
S0=$(date +%s)
left() { echo $(( 560 - ($(date +%s) - S0) )); }
timeout 240 python -m benchmarks.sweep --only gemvfused --gemv-batches 1 --gemv-grid compact --deadline 190 --out /tmp/gf 2>&1 \
  | grep -v Warning > $OUT/call1-gemvfused.txt
cp /tmp/gf/sweep.json $OUT/call1-gemvfused.json 2>/dev/null
grep -E "default|FAILED" $OUT/call1-gemvfused.txt | head; echo "--- best per group"
python - <<'PY'
import json, os
try:
    rows = json.load(open("/tmp/gf/sweep.json"))["rows"]
except Exception as e:
    print("no json", e); raise SystemExit
by = {}
for r in rows:
    if r.get("section") == "gemvfused" and "us" in r:
        by.setdefault(r["shape"], []).append(r)
for g, rs in by.items():
    d = [r for r in rs if r["setting"].endswith("default")]
    b = min(rs, key=lambda r: r["us"])
    print(f"{g:8} default {d[0]['us']:7.1f} us {d[0]['TB/s']:.2f} TB/s | best {b['us']:7.1f} us {b['TB/s']:.2f} TB/s {b['setting']} | cuBLAS {b['cublas_us']:.1f}")
PY
echo "gemvfused $(( $(date +%s) - S0 )) s"
L=$(left); timeout $L python -m benchmarks.ab --generate threshold0.5@4096 --dynamic-capacity \
  --variant default= --variant compact=gemv.compact=true --rounds 1 --timeout $(( L / 2 - 20 )) --out $OUT/ab 2>&1 | grep -v Warning | tail -12
echo "ab $(( $(date +%s) - S0 )) s"
L=$(left); [ $L -gt 120 ] && timeout $L python -m benchmarks.trace_step --settings threshold0.5+quest0.2@32768,threshold0.5@4096 \
  --out $OUT/trace 2>&1 | grep -v Warning > $OUT/call1-trace.txt
grep -h -E "^## |^step " $OUT/trace/*.md 2>/dev/null | head -8
echo "trace $(( $(date +%s) - S0 )) s"
tar czf /tmp/cache.tgz .cache && split -b 15M /tmp/cache.tgz $OUT/cache.tgz. ; ls -la $OUT
echo "total $(( $(date +%s) - S0 )) s"
