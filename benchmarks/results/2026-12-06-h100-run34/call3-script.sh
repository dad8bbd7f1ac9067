export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
D=benchmarks/results/2026-12-06-h100-run34
timeout 200 python $D/acc-experiment.py > $OUT/acc.txt 2>&1; tail -25 $OUT/acc.txt
NCU=1 timeout 200 ncu --kernel-name regex:rows --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section InstructionStats --section MemoryWorkloadAnalysis_Chart python $D/acc-experiment.py > $OUT/ncu-acc.txt 2>&1
grep -n "rows_kernel\|Duration\|Registers Per\|Achieved Occ\|Spilling Req\|L1/TEX Cache Thr\|DRAM Thr\|Issue Slots\|Warp Cycles Per Issued" $OUT/ncu-acc.txt | head -40
timeout 150 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --launch-skip 0 python benchmarks/results/2026-12-06-h100-run34/ncu_select.py > $OUT/ncu-select.txt 2>&1
grep -n "^  [_a-zA-Z].*Context\|Duration\|DRAM Thr\|Registers Per\|Achieved Occ\|Grid Size" $OUT/ncu-select.txt | head -60
