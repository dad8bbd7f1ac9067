"""Experiment (run from the repository root on a CUDA machine): where the key-sketch bound's "rows"
kernel loses its time at 128K. Variants are source rewrites of today's kernel, all timed in one process:

- token-major: today's codes and kernel, several configs (``words=16`` reads a token's whole row a step,
  so a page's 1 KB of codes is one contiguous load);
- slice-major: the same kernel reading a page's codes slice by slice (the ``VW`` words of each of the page's
  16 tokens contiguous: 256 bytes a step). The codes stay token-major, so the bounds are wrong: only the
  time of the memory pattern is measured;
- load-only: either pattern with the arithmetic removed (the codes summed as floats): the floor of that
  read pattern, grid loads of the page's own term included;
- the bytes: a copy of the codes and of the page grids, read at the copy bandwidth.
"""
import dataclasses
import os
import importlib.util
import pathlib
import sys

import torch
import triton

from benchmarks.probes import D, H, filled_cache
from policyzoo.kernels.ops.sketch_page_bound import kernel as K
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig

SRC = pathlib.Path(K.__file__).read_text().replace("from ... import route", "from policyzoo.kernels import route")
ROW = "    word_row = word_ptr + b * s_wb + kv * s_wh + slot4 * s_wt + u4\n"
LOAD = "        words = tl.load(word_row + w0, mask=seen4, other=0)"
BODY_START = "        for k in tl.static_range(8):\n"
BODY_END = "            acc += _unit_float(words, k) * (qk * ((hi - lo) * (16.0 / 15.0)))\n"
for s in (ROW, LOAD, BODY_START, BODY_END):
    assert s in SRC, s


def variant(name: str, sliced: bool, load_only: bool):
    src = SRC
    if sliced:
        src = src.replace(ROW, "    word_row = word_ptr + b * s_wb + kv * s_wh + p4 * (PAGE * WORDS) + t4 * VW + u4\n")
        src = src.replace(LOAD, "        words = tl.load(word_row + w0 * PAGE, mask=seen4, other=0)")
    if load_only:
        i, j = src.index(BODY_START), src.index(BODY_END) + len(BODY_END)
        src = src[:i] + "        acc += words.to(tl.float32, bitcast=True)\n" + src[j:]
    path = pathlib.Path(f"/tmp/sketch_{name}.py")
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"sketch_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"sketch_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod


def bench(fn) -> float:
    fn()
    if not torch.cuda.is_available():  # a dry run of the script in Triton's interpreter
        return float("nan")
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


n = int(os.environ.get("CONTEXT", 131072))
cache = filled_cache(n)
codes, mn, mx = cache.key_sketch[0], cache.page_min[0], cache.page_max[0]
q = torch.randn(1, H, D, device=codes.device, dtype=torch.bfloat16)
args = (q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max", None)
nbytes = sum(t.numel() * t.element_size() for t in (codes, mn, mx))
print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}  torch {torch.__version__}  triton {triton.__version__}")
print(f"codes {tuple(codes.shape)} {codes.dtype}, grids {tuple(mn.shape)} {mn.dtype}: {nbytes / 1e6:.1f} MB")
copy_us = sum(bench(lambda t=t: t.clone()) for t in (codes, mn, mx))
print(f"{'copy (read + write)':<36} {copy_us:8.1f} us  -> read alone at that rate ~{copy_us / 2:.1f} us"
      f"  ({2 * nbytes / copy_us / 1e6:.2f} TB/s)")
base = SketchScoreConfig()
print(f"default config: {base}")
want = K.sketch_page_bound(*args, base)
mods = {(s, lo): variant(f"{int(s)}{int(lo)}", s, lo) for s in (False, True) for lo in (False, True)}
configs = [(8, 1, 4), (8, 1, 2), (4, 1, 4), (16, 1, 4), (8, 2, 4), (16, 2, 4), (32, 4, 4),
           (1, 1, 16), (2, 1, 16), (4, 1, 16), (2, 2, 16), (4, 2, 16), (8, 4, 16), (4, 1, 8), (8, 2, 8)]
print(f"{'method config (pages/warps/words)':<36} {'token':>8} {'slice':>8} {'tok-load':>9} {'slc-load':>9}  (us)")
for bp, w, vw in configs:
    cfg = dataclasses.replace(base, method="rows", block_p=bp, num_warps=w, words=vw)
    row = []
    for key in ((False, False), (True, False), (False, True), (True, True)):
        try:
            row.append(f"{bench(lambda m=mods[key]: m.sketch_page_bound(*args, cfg)):8.1f}")
        except Exception as e:  # a config a variant cannot compile: say so, go on
            row.append(f"{'fail':>8}")
            print(f"  {bp}/{w}/{vw} {key}: {type(e).__name__}: {str(e)[:120]}")
    got = mods[(False, False)].sketch_page_bound(*args, cfg)
    same = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"rows {bp}/{w}/{vw:<27} {row[0]} {row[1]} {row[2]:>9} {row[3]:>9}  token-major equals default: {same}", flush=True)
