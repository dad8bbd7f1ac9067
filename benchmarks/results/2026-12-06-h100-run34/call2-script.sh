export TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONPATH=$PWD
timeout 200 ncu --kernel-name regex:sketch --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables python benchmarks/results/2026-12-06-h100-run34/ncu_sketch.py > $OUT/ncu-sketch.txt 2>&1
tail -c 9000 $OUT/ncu-sketch.txt
