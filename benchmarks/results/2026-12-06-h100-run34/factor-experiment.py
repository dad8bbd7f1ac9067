"""Experiment (run from the repository root on a CUDA machine; on the CPU with TRITON_INTERPRET=1 N=1024):
the "rows" sketch kernel with its products factored as ``(f·step)·q`` (one product a token and
channel, shared by the group's heads) instead of ``f·(q·step)`` (the page's weights made per head),
against today's, checked against the reference and timed at 128K."""
import dataclasses, importlib.util, pathlib, sys
import torch, triton
from benchmarks.probes import filled_cache, H, D
from policyzoo.kernels import reference
from policyzoo.kernels.ops.sketch_page_bound import kernel as K, SketchScoreConfig

src = pathlib.Path(K.__file__).read_text().replace("from ... import route", "from policyzoo.kernels import route")
old = "            acc += _unit_float(words, k) * (qk * ((hi - lo) * (16.0 / 15.0)))\n"
assert old in src
src = src.replace(old, "            acc += (_unit_float(words, k) * ((hi - lo) * (16.0 / 15.0))) * qk\n")
path = pathlib.Path("/tmp/fac_kernel.py"); path.write_text(src)
spec = importlib.util.spec_from_file_location("fac_kernel", path); S = importlib.util.module_from_spec(spec)
sys.modules["fac_kernel"] = S; spec.loader.exec_module(S)

import os; n = int(os.environ.get("N", 131072))
cache = filled_cache(n)
q = torch.randn(1, H, D, device=cache.page_min[0].device, dtype=torch.bfloat16)
args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max", None)
ref = reference.sketch_page_bound(*args[:-1])
base = SketchScoreConfig()
cases = [("sum 4/4", K, dataclasses.replace(base, method="sum", block_p=4, num_warps=4))]
for bp, w, vw in ((8, 1, 4), (16, 1, 4), (8, 2, 4), (16, 2, 4), (4, 1, 4), (8, 1, 2), (16, 1, 2), (32, 2, 4), (32, 4, 4), (16, 4, 4)):
    cfg = dataclasses.replace(base, method="rows", block_p=bp, num_warps=w, words=vw)
    cases += [(f"today {bp}/{w}/{vw}", K, cfg), (f"factored {bp}/{w}/{vw}", S, cfg)]
if os.environ.get("NCU"):  # one launch of each rows kernel at the default tile, for Nsight Compute
    cases = [c for c in cases if c[0].endswith(" 8/1/4")]
for label, mod, cfg in cases:
    fn = lambda: mod.sketch_page_bound(*args, cfg)
    out = fn()
    ok = torch.isfinite(ref) == torch.isfinite(out)
    err = ((out - ref).abs()[torch.isfinite(ref)] / ref.abs()[torch.isfinite(ref)].clamp(min=1)).max().item()
    us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3 if out.is_cuda and not os.environ.get("NCU") else float("nan")
    print(f"{label:<22} {us:8.1f} us  max rel err {err:.1e} {'ok' if bool(ok.all()) and err < 1e-4 else 'WRONG'}", flush=True)
