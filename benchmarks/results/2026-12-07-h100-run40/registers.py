"""Run 40: the key-sketch bound's "half2" kernel under a register cap (`SketchScoreConfig.max_registers`,
ptxas' maxnreg) against the compiler's 255 registers, and "rows", on one layer (32 q / 8 KV heads,
head dim 128, pages of 16, bf16; `benchmarks.probes.filled_cache`). From the repository root on a
CUDA machine:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run40/registers.py [caps] [contexts] [out.json]

Offline (Triton 3.6, sm_90) the caps give: 255 (none) 4,416 instructions, no spills; 200: 4,472, no
spills; 184: 4,520, 22 spills; 168: 4,624, 73 spills. Each config is checked first: between the
reference and twice its slack above ("rows": the reference to rounding), the same -inf. Then a page
whose first token is at the top of its grid in every channel (the overflow the [256, 512) scaling
fixed) must stay finite.
"""
import dataclasses
import json
import sys

import torch
import triton

from benchmarks.probes import D, H, PAGE, filled_cache
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig, kernel as K
from policyzoo.kernels.ops.sketch_page_bound import reference as ref


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run in Triton's interpreter


def bench(fn) -> float:
    fn()
    if DEV == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median") * 1e3


caps = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "0,200,184,168").split(",")]
contexts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "131072,32768").split(",")]
out = sys.argv[3] if len(sys.argv) > 3 else None
results = []
print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
base = SketchScoreConfig()
configs = [("rows", dataclasses.replace(base, method="rows"))] + [
    (f"half2 max_registers={c}", dataclasses.replace(base, max_registers=c)) for c in caps]


def layer_args(cache, seed=2):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    return (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max")


def check(args, got, cfg) -> str:
    want = ref.sketch_page_bound(*args)
    live = want.isfinite()
    tol = 1e-4 * (1 + want[live].abs())
    if cfg.method == "rows":
        ok = bool(torch.allclose(got[live], want[live], rtol=1e-4, atol=1e-3))
    else:
        slack = 2 * ref.half2_slack(args[0], args[2], args[3], args[6], "max")
        ok = bool(((got[live] >= want[live] - tol) & (got[live] <= want[live] + slack[live] + tol)).all())
    ok = ok and torch.equal(got.isneginf(), want.isneginf())
    return "ok" if ok else "WRONG"


# The overflow case: every page's token 0 at the top of its grid in every channel, a query of ones.
cache = filled_cache(512)
keys = cache.keys[0]
keys[:, :, :512] = 0
keys[:, :, 0:512:PAGE] = 3.66
cache.summarise(0, slice(0, 512 // PAGE))
q, *rest = layer_args(cache)
args = (torch.ones_like(q), *rest)
for name, cfg in configs[1:2]:
    got = K.sketch_page_bound(*args, None, cfg)
    print(f"top of the grid, {name}: finite {bool(got[..., : 512 // PAGE].isfinite().all())}, {check(args, got, cfg)}", flush=True)
del cache

for n in contexts:
    cache = filled_cache(n)
    args = layer_args(cache)
    mb = sum(t.numel() * t.element_size() for t in args[1:4]) / 1e6
    print(f"\n{n} tokens: codes and grids {mb:.1f} MB", flush=True)
    for name, cfg in configs:
        try:
            got = K.sketch_page_bound(*args, None, cfg)
            verdict = check(args, got, cfg)
            us = bench(lambda: K.sketch_page_bound(*args, None, cfg))
            print(f"{name:<28} {us:8.1f} µs  {mb / us:5.2f} TB/s  {verdict}", flush=True)
            results.append(dict(config=name, method=cfg.method, max_registers=cfg.max_registers, context=n, us=us,
                                check=verdict))
            if out:
                json.dump(results, open(out, "w"), indent=1)
        except Exception as e:  # a config that cannot compile: say so, go on
            print(f"{name:<28} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    del cache
