"""One eager box selection of `Quest(0.1)` at 128K and one attention over it, for Nsight Compute:

    ncu --section SpeedOfLight ... python benchmarks/results/2026-12-06-h100-run34/ncu_select.py
"""
import torch
from benchmarks.probes import filled_cache, H, D, PAGE
from policyzoo import Quest, kernels
from policyzoo.kv.base import KVState

n = 131072
cache = filled_cache(n)
state = KVState(cache, 0, D**-0.5, workspace=kernels.Workspace("cuda"))
q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
policy = Quest(0.1, page=PAGE, window=64)
for _ in range(2):
    sel = policy.select(state, q)
    out = kernels.decode_attention(q, state.keys, state.values, sel, cache.start, cache.length, state.scale)
torch.cuda.synchronize()
print("kept pages", sel.count.float().mean().item())
