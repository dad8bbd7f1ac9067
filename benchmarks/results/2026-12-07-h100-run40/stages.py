"""Run 40: attention over a tenth of the pages with deeper software pipelining. Call 2 found the
placement of the pages irrelevant (contiguous pages read no faster than random ones): the kernel's
short loops are the limit. Here small tiles (one or two pages) with many stages in flight, against
the default (64-token tiles, two stages), on the random selection and on dense attention, at 128K
and 32K; CUDA graphs over three copies of the layer as in `locality.py`. From the repository root on
a CUDA machine:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run40/stages.py
"""
import dataclasses
import math
import pathlib
import sys

import torch
import triton

from benchmarks.probes import D, H_KV, PAGE, _dense_layer
from policyzoo.kernels import AttentionConfig
from policyzoo.kernels.config import override
from policyzoo.selection import Selection

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from locality import graph_us  # noqa: E402

dev = "cuda"
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)


base = AttentionConfig()
configs = [("default (64-token tiles, 2 stages)", base)] + [
    (f"block_t {bt}, {st} stages, {tp} programs", dataclasses.replace(base, block_t=bt, num_stages=st, target_programs=tp))
    for bt, st, tp in ((16, 4, 512), (16, 6, 512), (16, 8, 512), (32, 4, 512), (32, 6, 512), (16, 6, 1024),
                       (32, 4, 1024), (64, 3, 512), (64, 4, 512))]
for n in (131072, 32768):
    layers = [_dense_layer(n) for _ in range(3)]
    pages = n // PAGE
    k = math.ceil(pages / 10)
    g = torch.Generator(device=dev).manual_seed(3)
    idx = torch.stack([torch.randperm(pages, device=dev, generator=g)[:k].sort().values for _ in range(H_KV)]).int()
    sparse = Selection(idx[None].contiguous(), torch.full((1, H_KV), k, device=dev, dtype=torch.int32), block=PAGE)
    mb, dense_mb = 2 * H_KV * k * PAGE * D * 2 / 1e6, 2 * H_KV * n * D * 2 / 1e6
    print(f"\n{n} tokens: a tenth of the pages {mb:.1f} MB, dense {dense_mb:.0f} MB", flush=True)
    want = {}
    for name, cfg in configs:
        try:
            with override(attention=cfg):
                row = []
                for label, sel, size in (("tenth", sparse, mb), ("dense", layers[0][5], dense_mb)):
                    us, out = graph_us(layers, sel)
                    same = label not in want or torch.allclose(out.float(), want[label].float(), rtol=2e-2, atol=2e-2)
                    want.setdefault(label, out.clone())
                    row.append(f"{label} {us:7.1f} µs {size / us:5.2f} TB/s{'' if same else ' DIFFERS'}")
            print(f"{name:<38} " + "   ".join(row), flush=True)
        except Exception as e:
            print(f"{name:<38} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    del layers
    torch.cuda.empty_cache()
