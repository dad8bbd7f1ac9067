#!/usr/bin/env bash
# Run 42, call 2: the split merge (attn_variants.py --merge), then Nsight Compute on the two launches.
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.cache/triton PYTHONPATH=$PWD
D=benchmarks/results/2026-12-07-h100-run42
nvidia-smi --query-gpu=name --format=csv,noheader
S0=$(date +%s)
timeout 120 python $D/attn_variants.py --merge 2>&1 | grep -v Warning | tee $OUT/call2-merge.txt
echo "merge $(( $(date +%s) - S0 )) s"
timeout 200 ncu --kernel-name regex:'_softmax_chunk|_merge' --launch-skip 2 --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  python $D/ncu_attention.py > $OUT/call2-ncu.txt 2>&1
grep -E "profiling|_softmax_chunk|_merge|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|No Eligible|Stall" $OUT/call2-ncu.txt | head -80
echo "total $(( $(date +%s) - S0 )) s"
