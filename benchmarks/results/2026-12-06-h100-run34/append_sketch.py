"""The decode step's cache append on a key-sketch cache, one layer of the Llama-3.1-8B shape (8 KV
heads, head dim 128, pages of 16) at context N (default 32768), compiled with Inductor and timed in
a CUDA graph: the page's codes recoded inside `kernels.cache_append` (this tree) against the
append followed by the torch recode (`PagedKVCache._encode`, the previous `write`), each checked
against the other. From the repository root, on a CUDA machine:

    python benchmarks/results/2026-12-06-h100-run34/append_sketch.py
"""
import os

import torch

from benchmarks import common
from policyzoo import kernels
from policyzoo.cache import SKETCH, SUMMARIES, PagedKVCache

n, H_KV, D, PAGE = int(os.environ.get("N", 32768)), 8, 128, 16
dev = common.DEVICE
caches = []
for _ in range(2):
    c = PagedKVCache(1, 1, H_KV, D, n + 2 * PAGE, page_size=PAGE, dtype=torch.bfloat16, device=dev,
                     summaries=("page_min", "page_max", SKETCH))
    c.keys[0].copy_(torch.randn(c.keys[0].shape, generator=torch.Generator().manual_seed(0)).to(c.keys[0]))
    c.reset(torch.zeros(1, dtype=torch.long, device=dev), n + PAGE // 2)
    c.summarise(0, slice(0, c.num_pages))
    caches.append(c)
k, v = (torch.randn(1, H_KV, 1, D, device=dev, dtype=torch.bfloat16) for _ in range(2))


def fused(c=caches[0]):
    c.write(0, k, v)


def previous(c=caches[1]):
    kept = tuple(getattr(c, name)[0] if c.keeps(name) else None for name in SUMMARIES)
    kernels.cache_append(k, v, c.keys[0], c.values[0], kept, c.start, c.length, c.page_size)
    c._encode(0, torch.div(c.length - 1, c.page_size, rounding_mode="floor").reshape(1))


for name, fn in (("fused (kernel)", fused), ("append + torch recode", previous)):
    compiled = torch.compile(fn, fullgraph=True)
    compiled()
    us = common.graph_time_ms(compiled) * 1e3
    print(f"{name:<24} {us:7.2f} us a layer (compiled, CUDA graph)", flush=True)
same = all(torch.equal(a, b) for a, b in zip(caches[0].tensors(), caches[1].tensors()))
print("caches equal:", same)
