"""Run 37, call 2 (from the repository root on a CUDA machine): the key-sketch bound's new "columns"
method against "rows" (the default) on one layer of the Llama-3.1-8B shape, every config timed in
one process, each checked against the reference first. Prints ``BEST <overrides>``: the fastest
columns config as `benchmarks.ab` variant settings."""
import dataclasses
import os

import torch
import triton

from benchmarks.probes import D, H, filled_cache
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig
from policyzoo.kernels.ops.sketch_page_bound import kernel as K
from policyzoo.kernels.ops.sketch_page_bound import reference as R

CUDA = torch.cuda.is_available()


def bench(fn) -> float:
    fn()
    if not CUDA:  # a dry run in Triton's interpreter
        return float("nan")
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


base = SketchScoreConfig()
rows_cfgs = [base, dataclasses.replace(base, block_p=16)]
col_cfgs = [SketchScoreConfig(method="columns", block_p=bp, num_warps=w, words=vw) for bp, w, vw in (
    (8, 1, 4), (4, 1, 4), (16, 1, 4), (16, 2, 4), (32, 4, 4),
    (4, 1, 2), (8, 2, 2), (8, 1, 2), (2, 1, 1), (4, 2, 1), (16, 1, 8), (8, 1, 8), (32, 1, 16), (16, 1, 16))]
contexts = [int(c) for c in os.environ.get("CONTEXTS", "131072,32768").split(",")]
best: dict[int, tuple[float, SketchScoreConfig]] = {}
for n in contexts:
    cache = filled_cache(n)
    codes, mn, mx = cache.key_sketch[0], cache.page_min[0], cache.page_max[0]
    q = torch.randn(1, H, D, device=codes.device, dtype=torch.bfloat16)
    n_pages = mn.shape[2]
    listed = torch.stack([torch.randperm(n_pages, device=codes.device)[: max(1, n_pages * 4 // 10)] for _ in range(mn.shape[1])])[None].int()
    want = R.sketch_page_bound(q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max")
    want_listed = R.sketch_page_bound(q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max", listed)
    print(f"\n## context {n}: {n_pages} pages, listed {listed.shape[-1]} a head (nominate=4 at keep 0.1)")
    print(f"{'config':<58} {'all us':>8} {'listed us':>10}  max |err| (all, listed)")
    for cfg in rows_cfgs + col_cfgs:
        try:
            got = K.sketch_page_bound(q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max", None, cfg)
            got_l = K.sketch_page_bound(q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max", listed, cfg)
            live, live_l = want.isfinite(), want_listed.isfinite()
            ok = torch.equal(got.isneginf(), want.isneginf()) and torch.equal(got_l.isneginf(), want_listed.isneginf())
            err = (got[live] - want[live]).abs().max().item()
            err_l = (got_l[live_l] - want_listed[live_l]).abs().max().item() if live_l.any() else 0.0
            t_all = bench(lambda: K.sketch_page_bound(q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max", None, cfg))
            t_l = bench(lambda: K.sketch_page_bound(q, codes, mn, mx, cache.start, cache.length, D**-0.5, "max", listed, cfg))
        except Exception as e:  # a config that does not compile: say so, go on
            print(f"{str(cfg):<58} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        print(f"{cfg.method} block_p={cfg.block_p} warps={cfg.num_warps} words={cfg.words:<22} {t_all:8.1f} {t_l:10.1f}  "
              f"{err:.2e}, {err_l:.2e}{'' if ok and err < 1e-3 and err_l < 1e-3 else '  WRONG'}", flush=True)
        if cfg.method == "columns" and ok and err < 1e-3 and (n not in best or t_all < best[n][0]):
            best[n] = (t_all, cfg)
    del cache
if best:
    _, cfg = best[max(best)]
    print(f"BEST sketch_score.method=columns,sketch_score.block_p={cfg.block_p},sketch_score.num_warps={cfg.num_warps},sketch_score.words={cfg.words}")
