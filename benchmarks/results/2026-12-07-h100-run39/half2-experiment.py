"""Run 39: the key-sketch bound's "half2" method (one token a step, no head axis) against "rows" on one layer (32 q / 8 KV heads, head
dim 128, pages of 16, bf16; `benchmarks.probes.filled_cache`), from the repository root on a CUDA machine:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run39/half2-experiment.py [contexts]

For each context: the bound of every page and of a list of 40% of the pages (a two-level selection's
candidates), each config's µs (`triton.testing.do_bench`, median), checked first: "rows" against the
reference to rounding; "half2" between the reference and twice its slack above, and its listed bounds
equal to its full ones at the listed pages.
"""
import dataclasses
import sys

import torch
import triton

from benchmarks.probes import D, H, filled_cache
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig, half2, kernel as K  # noqa: F401
from policyzoo.kernels.ops.sketch_page_bound import reference as ref


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run in Triton's interpreter


def bench(fn) -> float:
    fn()
    if DEV == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


contexts = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "32768,131072").split(",")]
print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
base = SketchScoreConfig()
configs = [("rows", dataclasses.replace(base, method="rows"))] + [
    (f"half2 {bp}/{w}", dataclasses.replace(base, method="half2", block_p=bp, num_warps=w))
    for bp, w in ((8, 1), (4, 1), (16, 2), (8, 2), (32, 4), (16, 4))]
for n in contexts:
    cache = filled_cache(n)
    codes, mn, mx = cache.key_sketch[0], cache.page_min[0], cache.page_max[0]
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(1, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    n_pages = mn.shape[2]
    listed = torch.stack([torch.randperm(n_pages, device=DEV, generator=g)[: int(0.4 * n_pages)] for _ in range(mn.shape[1])])
    listed = listed.sort(-1).values[None].int()  # [1, H_kv, K], ascending as a selection's candidates
    scale = D**-0.5
    args = (q, codes, mn, mx, cache.start, cache.length, scale, "max")
    want = ref.sketch_page_bound(*args)
    g_ = H // mn.shape[1]
    slack = 2 * ref.half2_slack(q, mn, mx, scale, "max")
    radius = (scale * torch.einsum("bkgd,bkpd->bkgp", q.float().abs().view(1, -1, g_, D), ref.sketch_grid(mn, mx)[2])).amax(2)
    mb = sum(t.numel() * t.element_size() for t in (codes, mn, mx)) / 1e6
    print(f"\n{n} tokens: codes and grids {mb:.1f} MB; half2's slack is {100 * (slack / 2 / radius)[want.isfinite() & (radius > 0)].mean().item():.1f}% "
          f"of the radius term on average", flush=True)
    print(f"{'config (pages/warps)':<28} {'all µs':>8} {'40% µs':>8}  check", flush=True)
    for name, cfg in configs:
        try:
            bound = K.sketch_page_bound
            got = bound(*args, None, cfg)
            sub = bound(*args, listed, cfg)
            at = torch.gather(got, 2, listed.long())
            live = want.isfinite()
            tol = 1e-4 * (1 + want[live].abs())
            if cfg.method == "rows":
                checks = {"close": bool(torch.allclose(got[live], want[live], rtol=1e-4, atol=1e-3))}
            else:
                checks = {"within slack": bool(((got[live] >= want[live] - tol) & (got[live] <= want[live] + slack[live] + tol)).all())}
            checks |= {"-inf": torch.equal(got.isneginf(), want.isneginf()), "listed": torch.equal(sub, at)}
            ok = all(checks.values())
            t_all = bench(lambda: bound(*args, None, cfg))
            t_sub = bench(lambda: bound(*args, listed, cfg))
            print(f"{name:<28} {t_all:8.1f} {t_sub:8.1f}  {'ok' if ok else 'WRONG ' + ','.join(k for k, v in checks.items() if not v)}  "
                  f"(mean above the reference {(got[live] - want[live]).mean().item():.4f})", flush=True)
        except Exception as e:  # a config that cannot compile: say so, go on
            print(f"{name:<28} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    del cache
    torch.cuda.empty_cache()
