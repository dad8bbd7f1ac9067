#!/usr/bin/env bash
# Run 38, call 1: the half2 sketch kernel's tests on the GPU, its timing against "rows" on one layer,
# then one layer's selection with each at 128K (select_ab.py), as far as the call's time allows (220 s).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
R=benchmarks/results/2026-12-07-offline-run38
S0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/call1-gpu.txt
python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" | tee -a $OUT/call1-gpu.txt
timeout 120 python $R/half2-experiment.py 2>&1 | grep -v Warning | tee $OUT/call1-kernel.txt
echo "kernel $(( $(date +%s) - S0 )) s"
timeout 60 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k "half2 or sketch_page_bound_listed" > $OUT/call1-tests.txt 2>&1; tail -3 $OUT/call1-tests.txt
echo "tests $(( $(date +%s) - S0 )) s"
LEFT=$(( 220 - ($(date +%s) - S0) ))
timeout $LEFT python $R/select_ab.py 131072 $OUT/call1-select.json > $OUT/call1-select.txt 2>&1; grep -v Warning $OUT/call1-select.txt | tail -30
echo "total $(( $(date +%s) - S0 )) s"
tar czf $OUT/cache.tgz .cache 2>/dev/null; ls -la $OUT/cache.tgz
