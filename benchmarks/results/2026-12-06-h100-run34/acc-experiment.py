"""Experiment (run from the repository root on a CUDA machine): the "rows" sketch kernel with its
accumulator summed over the words of a step inside the loop ([PAGE, BLOCK_P, G] instead of
[PAGE, BLOCK_P, VW, G]: a quarter of the registers at VW=4), against today's, checked against the
reference and timed at 128K. Nsight Compute showed today's kernel at 168 registers a thread
(occupancy 18.75%), spilling, with L1 the busiest unit."""
import dataclasses, importlib.util, pathlib, sys
import torch, triton
from benchmarks.probes import filled_cache, H, D
from policyzoo.kernels import reference
from policyzoo.kernels.ops.sketch_page_bound import kernel as K, SketchScoreConfig

src = pathlib.Path(K.__file__).read_text().replace("from ... import route", "from policyzoo.kernels import route")
for old, new in [
    ("    acc = tl.zeros([PAGE, BLOCK_P, VW, G_PAD], tl.float32)\n", "    acc = tl.zeros([PAGE, BLOCK_P, G_PAD], tl.float32)\n"),
    ("            acc += _unit_float(words, k) * (qk * ((hi - lo) * (16.0 / 15.0)))\n",
     "            acc += tl.sum(_unit_float(words, k) * (qk * ((hi - lo) * (16.0 / 15.0))), 2)\n"),
    ("    coded = tl.sum(acc, 2)  # [PAGE, BLOCK_P, G_PAD]\n", "    coded = acc\n"),
]:
    assert old in src, old
    src = src.replace(old, new)
path = pathlib.Path("/tmp/acc_kernel.py"); path.write_text(src)
spec = importlib.util.spec_from_file_location("acc_kernel", path); S = importlib.util.module_from_spec(spec)
sys.modules["acc_kernel"] = S; spec.loader.exec_module(S)

import os; n = int(os.environ.get("N", 131072))
cache = filled_cache(n)
q = torch.randn(1, H, D, device=cache.page_min[0].device, dtype=torch.bfloat16)
args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max", None)
ref = reference.sketch_page_bound(*args[:-1])
base = SketchScoreConfig()
cases = [("sum 4/4", K, dataclasses.replace(base, method="sum", block_p=4, num_warps=4))]
for bp, w, vw in ((8, 1, 4), (16, 1, 4), (8, 2, 4), (16, 2, 4), (4, 1, 4), (8, 1, 2), (16, 1, 2), (32, 2, 4), (32, 4, 4), (16, 4, 4)):
    cfg = dataclasses.replace(base, method="rows", block_p=bp, num_warps=w, words=vw)
    cases += [(f"today {bp}/{w}/{vw}", K, cfg), (f"acc-sum {bp}/{w}/{vw}", S, cfg)]
if os.environ.get("NCU"):  # one launch of each rows kernel at the default tile, for Nsight Compute
    cases = [c for c in cases if c[0].endswith(" 8/1/4")]
for label, mod, cfg in cases:
    fn = lambda: mod.sketch_page_bound(*args, cfg)
    out = fn()
    ok = torch.isfinite(ref) == torch.isfinite(out)
    err = ((out - ref).abs()[torch.isfinite(ref)] / ref.abs()[torch.isfinite(ref)].clamp(min=1)).max().item()
    us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3 if out.is_cuda and not os.environ.get("NCU") else float("nan")
    print(f"{label:<22} {us:8.1f} us  max rel err {err:.1e} {'ok' if bool(ok.all()) and err < 1e-4 else 'WRONG'}", flush=True)
