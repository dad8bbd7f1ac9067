"""Experiment (run from the repository root on a CUDA machine): the "rows" sketch kernel reading slice-major codes (a page's tokens' words w0..w0+VW-1
contiguous) against the token-major codes it reads today. The sliced reads give wrong bounds (the
codes stay token-major): only the time of the memory pattern is measured."""
import importlib.util, pathlib, re, sys, dataclasses
import torch, triton
from benchmarks.probes import filled_cache, H, D
from policyzoo.kernels.ops.sketch_page_bound import kernel as K, SketchScoreConfig

src = pathlib.Path(K.__file__).read_text()
src = src.replace("from ... import route", "from policyzoo.kernels import route")
old = "    word_row = word_ptr + b * s_wb + kv * s_wh + slot4 * s_wt + u4\n"
assert old in src
src = src.replace(old, "    word_row = word_ptr + b * s_wb + kv * s_wh + p4 * (PAGE * WORDS) + t4 * VW + u4\n")
old = "        words = tl.load(word_row + w0, mask=seen4, other=0)"
assert old in src
src = src.replace(old, "        words = tl.load(word_row + w0 * PAGE, mask=seen4, other=0)")
path = pathlib.Path("/tmp/sliced_kernel.py"); path.write_text(src)
spec = importlib.util.spec_from_file_location("sliced_kernel", path); S = importlib.util.module_from_spec(spec)
sys.modules["sliced_kernel"] = S; spec.loader.exec_module(S)

n = 131072
cache = filled_cache(n)
q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max", None)
base = SketchScoreConfig()
rows = []
for label, mod, cfg in [("sum 4/4", K, dataclasses.replace(base, method="sum", block_p=4, num_warps=4))] + [
        (f"{name} {bp}/{w}/{vw}", mod, dataclasses.replace(base, method="rows", block_p=bp, num_warps=w, words=vw))
        for bp, w, vw in ((8, 1, 4), (8, 1, 2), (16, 1, 4), (16, 2, 4), (8, 2, 4), (32, 4, 4), (4, 1, 4), (16, 1, 2))
        for name, mod in (("token-major", K), ("slice-major", S))]:
    fn = lambda: mod.sketch_page_bound(*args, cfg)
    fn(); torch.cuda.synchronize()
    us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    print(f"{label:<28} {us:8.1f} us", flush=True)
