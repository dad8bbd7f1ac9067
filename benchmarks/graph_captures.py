"""Does a CUDA graph replay slower when other graphs were captured before it in the process?

A minimal program, with no policyzoo in it: a chain of many small kernels (as a decode step is)
captured in a fresh `torch.cuda.CUDAGraph` again and again, each replay timed with CUDA events
(median of many)::

    python -m benchmarks.graph_captures --captures 8 --kernels 600
"""

from __future__ import annotations

import argparse
import statistics

import torch


def chain(x: torch.Tensor, w: torch.Tensor, kernels: int) -> torch.Tensor:
    for _ in range(kernels // 2):
        x = torch.mv(w, x)
        x = x * 0.5
    return x


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--captures", type=int, default=8)
    p.add_argument("--kernels", type=int, default=600)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--keep", action="store_true", help="keep every graph alive (default: each freed before the next)")
    p.add_argument("--streams", action="store_true", help="capture and replay each graph on a stream of its own")
    p.add_argument("--pool", action="store_true", help="capture every graph into one shared memory pool")
    args = p.parse_args(argv)
    pool = torch.cuda.graph_pool_handle() if args.pool else None
    w = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.size, device="cuda", dtype=torch.bfloat16)
    kept = []
    for k in range(1, args.captures + 1):
        chain(x, w, args.kernels)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream() if args.streams else torch.cuda.current_stream()
        with torch.cuda.graph(graph, pool=pool, stream=stream if args.streams else None):
            chain(x, w, args.kernels)
        with torch.cuda.stream(stream):
            replay_ms(graph, 5)
            print(f"capture {k}: replay {replay_ms(graph):.4f} ms", flush=True)
        if args.keep:
            kept.append(graph)
        del graph


if __name__ == "__main__":
    main()
