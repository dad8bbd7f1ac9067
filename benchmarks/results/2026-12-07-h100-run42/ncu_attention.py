"""Run 42, call 2: Nsight Compute on `kernels.decode_attention`'s two launches over a tenth of the
pages at 32K and 128K and over every page at 32K (one call each, after a warm-up call). On a CUDA
machine, from the repository root:

    ncu --kernel-name regex:'_softmax_chunk|_merge' --launch-skip 2 --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis python benchmarks/results/2026-12-07-h100-run42/ncu_attention.py
"""
import pathlib
import sys

import torch

from benchmarks.probes import D
from policyzoo import kernels

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from attn_variants import case_inputs  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(3)
inputs = [case_inputs(kind, n, g) for kind, n in (("tenth", 32768), ("tenth", 131072), ("dense", 32768))]
layers, sel, _, _ = inputs[0]
kernels.decode_attention(*layers[0][:3], sel, *layers[0][3:5], D**-0.5)  # compiles; not profiled
torch.cuda.synchronize()
for kind, (layers, sel, _, _) in zip(("tenth 32K", "tenth 128K", "dense 32K"), inputs):
    print("profiling", kind, flush=True)
    kernels.decode_attention(*layers[0][:3], sel, *layers[0][3:5], D**-0.5)
    torch.cuda.synchronize()
