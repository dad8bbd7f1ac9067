#!/usr/bin/env bash
# For the next device call (not run in run 39): the half2 kernel alone at 32K and 128K against "rows"
# (call 3's kernel timings were spoiled by its test step), then with token-loop.patch applied (12 s
# to compile instead of 43: does it keep the speed?), then Nsight Compute over both kernels.
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
D=benchmarks/results/2026-12-07-h100-run39
S0=$(date +%s)
timeout 150 python $D/half2-experiment.py 2>&1 | grep -v Warning | tee $OUT/kernel-static.txt
echo "static $(( $(date +%s) - S0 )) s"
git apply $D/token-loop.patch && timeout 150 python $D/half2-experiment.py 2>&1 | grep -v Warning | tee $OUT/kernel-token-loop.txt
git checkout policyzoo/kernels/ops/sketch_page_bound/half2.py
echo "token loop $(( $(date +%s) - S0 )) s"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 200 $NCU --kernel-name regex:"rows|half2" --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats python $D/ncu_half2.py > $OUT/ncu.txt 2>&1
grep -n "rows:\|_kernel\|Duration\|DRAM Throughput\|Registers Per\|Achieved Occ\|Issue Slots Busy\|Warp Cycles Per Issued\|Executed Instructions  " $OUT/ncu.txt | head -60
echo "total $(( $(date +%s) - S0 )) s"
