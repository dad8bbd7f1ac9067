"""Run 41: EntmaxKV's pooled threshold (`kernels.gaussian_entmax_threshold`) with its last Newton
steps in float64 (``float64_steps=3``, the default before this run) and with every step in float32
(``float64_steps=0``, now `EntmaxKV`'s default): one layer's rows ``[1, 32, P]`` at 128K (8,196 pages)
and 32K (2,052), time in a CUDA graph, and each result's distance from the float64 reference's root
in units of the pool's scale (``1 + max |m| + s``). From the repository root on a CUDA machine:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run41/threshold.py [pages,...]

(16,388 pages, a 256K cache, takes the walked path: slices too long to hold in registers.)
"""
import sys

import torch
import triton

from benchmarks import common
from policyzoo import kernels
from policyzoo.kernels import Workspace
from policyzoo.kernels.ops.entmax_threshold import reference as R

dev = "cuda"
ws = Workspace(torch.device(dev))
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
for P in [int(p) for p in (sys.argv[1] if len(sys.argv) > 1 else "8196,2052").split(",")]:
    g = torch.Generator(device=dev).manual_seed(2)
    m0 = torch.randn(1, 32, P, device=dev, generator=g)
    s0 = torch.rand(1, 32, P, device=dev, generator=g)
    n = torch.full((1, 32, P), 16, device=dev, dtype=torch.int32)
    for spread, width in ((1.0, 0.3), (10.0, 0.3), (10.0, 1.0)):
        m, s = m0 * spread, s0 * spread * width
        cap = m + 2.0 * spread
        root = R.gaussian_entmax_threshold(m.double(), s.double(), n, cap.double(), 12)
        scale = 1 + (m.abs() + s).amax(-1, keepdim=True).double()
        for f64 in (3, 0):
            out = kernels.gaussian_entmax_threshold(m, s, n, cap, 12, f64, workspace=ws)
            us = common.graph_time_ms(lambda: kernels.gaussian_entmax_threshold(m, s, n, cap, 12, f64, workspace=ws)) * 1e3
            err = float(((out - root).abs() / scale).max())
            print(f"P={P} spread={spread} width={width} float64_steps={f64}: {us:6.1f} us, "
                  f"|tau - root| / scale {err:.1e}", flush=True)
