"""Run 40: the half2 kernel's token loop in runtime steps (`SketchScoreConfig.token_step`): Triton's
compile time and the kernel's speed, on one layer (32 q / 8 KV heads, head dim 128, pages of 16,
bf16; `benchmarks.probes.filled_cache`). Offline (Triton 3.6, sm_90) steps of 16 / 8 / 4 compile in
43 / 26 / 18 s (the TritonGPUCoalesce pass is 98% of it) and execute 4,416 / 4,407 / 4,479 warp
instructions a program. From the repository root on a CUDA machine, with an empty Triton cache:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run40/tokens.py [steps] [contexts]
"""
import dataclasses
import sys
import time

import torch
import triton

from benchmarks.probes import D, H, filled_cache
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig, kernel as K
from policyzoo.kernels.ops.sketch_page_bound import reference as ref

steps = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "16,8,4").split(",")]
contexts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "131072,32768").split(",")]
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
base = SketchScoreConfig()
for n in contexts:
    cache = filled_cache(n)
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5, "max")
    mb = sum(t.numel() * t.element_size() for t in args[1:4]) / 1e6
    want = ref.sketch_page_bound(*args)
    live = want.isfinite()
    slack = 2 * ref.half2_slack(q, args[2], args[3], args[6], "max")
    print(f"\n{n} tokens: codes and grids {mb:.1f} MB", flush=True)
    first = None
    for step in steps:
        cfg = dataclasses.replace(base, token_step=step)
        t0 = time.perf_counter()
        got = K.sketch_page_bound(*args, None, cfg)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        tol = 1e-4 * (1 + want[live].abs())
        ok = bool(((got[live] >= want[live] - tol) & (got[live] <= want[live] + slack[live] + tol)).all())
        ok = ok and torch.equal(got.isneginf(), want.isneginf())
        first = got if first is None else first
        us = triton.testing.do_bench(lambda: K.sketch_page_bound(*args, None, cfg), warmup=25, rep=300,
                                     return_mode="median") * 1e3
        print(f"token_step {step:>2}: {us:7.1f} µs  {mb / us:5.2f} TB/s  first call {first_s:5.1f} s  "
              f"{'ok' if ok else 'WRONG'}{'' if torch.equal(got, first) else ' (bits differ from the first step)'}",
              flush=True)
    del cache
