#!/usr/bin/env bash
# Run 39, call 2: Nsight Compute over the "rows" and "half2" sketch kernels at 128K (why half2 is slower).
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
[ -f .old2-cache.tgz ] && tar xzf .old2-cache.tgz
D=benchmarks/results/2026-12-07-h100-run39
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 400 $NCU --kernel-name regex:"rows|half2" --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis_Tables python $D/ncu_half2.py > $OUT/call2-ncu.txt 2>&1
grep -n "rows:\|_kernel\|Duration\|DRAM Throughput\|Registers Per\|Achieved Occ\|Theoretical Occ\|Spilling\|L1/TEX Cache Thr\|Issue Slots Busy\|Warp Cycles Per Issued\|Executed Instructions  \|Block Limit Reg\|Local Memory\|Grid Size\|Mem Busy\|Max Bandwidth\|L2 Hit" $OUT/call2-ncu.txt | head -90
