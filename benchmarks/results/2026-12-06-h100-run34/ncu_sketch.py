"""One launch of the key-sketch bound's rows kernel (and the sum's) at 128K, for Nsight Compute:

    ncu --kernel-name regex:sketch --section SpeedOfLight ... python benchmarks/results/2026-12-06-h100-run34/ncu_sketch.py
"""
import dataclasses, torch
from benchmarks.probes import filled_cache, H, D
from policyzoo.kernels.ops.sketch_page_bound import kernel as K, SketchScoreConfig

cache = filled_cache(131072)
q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max", None)
base = SketchScoreConfig()
for cfg in (base, dataclasses.replace(base, method="sum", block_p=4, num_warps=4)):
    K.sketch_page_bound(*args, cfg)
torch.cuda.synchronize()
