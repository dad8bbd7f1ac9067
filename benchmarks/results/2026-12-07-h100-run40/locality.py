"""Run 40: why attention over a tenth of the pages reads ~1.9 TB/s where dense attention through the
same kernel reads ~2.9 (issue 38, item 4). One 128K layer (32 q / 8 KV heads, head dim 128, pages of
16, bf16), the same number of pages a KV head (a tenth), placed differently; timed calls go over
three copies of the layer in a CUDA graph, so every call reads its keys and values from memory. From the repository
root on a CUDA machine:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-h100-run40/locality.py [context]

If contiguous pages read as fast as dense and random ones do not, the gap is where the pages lie
(DRAM pages, TLB reach), not the kernel's loop; if both are slow, it is the kernel's short loops
(a tenth of the pages gives each program a few tiles).
"""
import dataclasses
import math
import sys

import torch
import triton

from benchmarks.probes import D, H_KV, PAGE, _dense_layer
from policyzoo import kernels
from policyzoo.kernels import AttentionConfig
from policyzoo.kernels.config import override
from policyzoo.selection import Selection


def graph_us(layers, sel) -> tuple[float, torch.Tensor]:
    """``(µs a call, the last call's output)``: one CUDA graph of a call on each copy of the layer
    (``_dense_layer`` tuples; no host time between the launches), replayed, its median over the
    copies (nan on a CPU, where the calls run once in Triton's interpreter)."""

    def calls():
        for q, keys, values, start, length, _ in layers:
            out, _ = kernels.decode_attention(q, keys, values, sel, start, length, D**-0.5)
        return out

    out = calls()
    assert bool(out.isfinite().all())
    if not out.is_cuda:
        return float("nan"), out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = calls()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=300, return_mode="median") * 1e3 / len(layers), out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run in Triton's interpreter
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    layers = [_dense_layer(n) for _ in range(3)]
    pages = n // PAGE
    k = math.ceil(pages / 10)
    g = torch.Generator(device=dev).manual_seed(3)


    def per_head(make):
        return torch.stack([make(h) for h in range(H_KV)]).int()[None].contiguous()


    def runs(length):
        starts = torch.randperm(pages // length, device=dev, generator=g)[: math.ceil(k / length)] * length
        return (starts[:, None] + torch.arange(length, device=dev)).flatten()[:k].sort().values


    placements = {
        "random (as Quest picks)": per_head(lambda h: torch.randperm(pages, device=dev, generator=g)[:k].sort().values),
        "random runs of 4 pages": per_head(lambda h: runs(4)),
        "random runs of 16 pages": per_head(lambda h: runs(16)),
        "every 10th page": per_head(lambda h: torch.arange(0, pages, 10, device=dev)[:k]),
        "random within a quarter": per_head(lambda h: torch.randperm(pages // 4, device=dev, generator=g)[:k].sort().values),
        "contiguous": per_head(lambda h: torch.arange(k, device=dev)),
    }
    count = torch.full((1, H_KV), k, device=dev, dtype=torch.int32)
    mb = 2 * H_KV * k * PAGE * D * 2 / 1e6
    dense_mb = 2 * H_KV * n * D * 2 / 1e6


    base = AttentionConfig()
    print(f"\n{n} tokens, {k} pages a KV head: {mb:.1f} MB selected (dense {dense_mb:.0f} MB)", flush=True)
    for programs in (512, 2048, 128) if dev == "cuda" else (512,):
        cfg = dataclasses.replace(base, target_programs=programs)
        with override(attention=cfg):
            dense = layers[0][5]
            us = graph_us(layers, dense)[0]
            print(f"target_programs {programs:>4}  {'dense':<28} {us:8.1f} µs  {dense_mb / us:5.2f} TB/s", flush=True)
            for name, idx in placements.items():
                us = graph_us(layers, Selection(idx, count, block=PAGE))[0]
                print(f"target_programs {programs:>4}  {name:<28} {us:8.1f} µs  {mb / us:5.2f} TB/s", flush=True)
