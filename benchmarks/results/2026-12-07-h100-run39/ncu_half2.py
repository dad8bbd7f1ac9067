"""One launch each of the key-sketch bound's "rows" kernel and its "half2" kernel (two tiles) at 128K,
for Nsight Compute; first, what the run-38 experiment's check of "rows" found (which test failed):

    ncu --kernel-name regex:"rows|half2" --section ... python benchmarks/results/2026-12-07-h100-run39/ncu_half2.py
"""
import dataclasses

import torch

from benchmarks.probes import D, H, filled_cache
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig, kernel as K
from policyzoo.kernels.ops.sketch_page_bound import reference as ref

cache = filled_cache(131072)
codes, mn, mx = cache.key_sketch[0], cache.page_min[0], cache.page_max[0]
g = torch.Generator(device="cuda").manual_seed(2)
q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
n_pages = mn.shape[2]
listed = torch.stack([torch.randperm(n_pages, device="cuda", generator=g)[: int(0.4 * n_pages)] for _ in range(mn.shape[1])])
listed = listed.sort(-1).values[None].int()
args = (q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max")
base = SketchScoreConfig()
want = ref.sketch_page_bound(*args)
rows = dataclasses.replace(base, method="rows")
got = K.sketch_page_bound(*args, None, rows)
sub = K.sketch_page_bound(*args, listed, rows)
at = torch.gather(got, 2, listed.long())
live = want.isfinite()
print("rows: allclose", bool(torch.allclose(got[live], want[live], rtol=1e-4, atol=1e-3)),
      "max |diff|", (got[live] - want[live]).abs().max().item(),
      "neginf equal", torch.equal(got.isneginf(), want.isneginf()),
      "listed equal", torch.equal(sub, at), "listed max |diff|", (sub - at).abs().max().item(), flush=True)
torch.cuda.synchronize()
for cfg in (dataclasses.replace(base, method="rows"), base, dataclasses.replace(base, block_p=4)):
    K.sketch_page_bound(*args, None, cfg)
torch.cuda.synchronize()
