"""CommunityKV's prefill clustering time per token graph on this machine's CPUs.

The graphs are shaped as a random 8B model's prefill makes them: 4 query heads per KV head, each
query's top 8 keys spread over the preceding 256 tokens, mixed half and half with co-attention.
``workers`` graphs are built, partitioned and split into parts of ``--split`` tokens (random bf16
keys of head dim 128) at once, in as many processes (as `CommunityKV` does)::

    python -m benchmarks.clustering --contexts 32768,131072 --workers 8 --split 4

``--runs N`` partitions each graph into runs of ``N`` consecutive tokens instead of by Leiden (the
sweep's ``community-kv0.1-runs10`` setting): the split then has many small communities to halve.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.common import runs_partition
from policyzoo.kv.community_graph import graph_communities


def synthetic_edges(n: int, seed: int, heads: int = 4, top: int = 8, spread: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, p) [heads, n, top]``: each query's ``top`` keys among the ``spread`` before it, with
    descending probabilities."""
    g = torch.Generator().manual_seed(seed)
    dst = (torch.arange(n)[None, :, None] - torch.randint(0, spread, (heads, n, top), generator=g)).clamp(min=0).int()
    p = torch.sort(torch.rand(heads, n, top, generator=g) ** 3, descending=True, dim=-1).values / 3
    return dst, p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="32768", help="prompt lengths, comma-separated")
    parser.add_argument("--workers", type=int, default=8, help="processes, and graphs per context")
    parser.add_argument("--resolution", type=float, default=10.0, help="CommunityKV's resolution per 1,000 tokens")
    parser.add_argument("--split", type=int, default=4, help="CommunityKV's split (0: none)")
    parser.add_argument("--runs", type=int, default=0, help="partition into runs of this many tokens, not by Leiden (0: Leiden)")
    args = parser.parse_args()
    if args.runs < 0:
        parser.error(f"--runs must be >= 0, got {args.runs}")
    partition = functools.partial(runs_partition, size=args.runs) if args.runs else None
    print(f"{os.cpu_count()} CPUs, {args.workers} processes", flush=True)
    context = mp.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        for n in (int(c) for c in args.contexts.split(",")):
            tic = time.perf_counter()
            jobs = [pool.submit(graph_communities, n, 0, *synthetic_edges(n, seed), 0.5, 4, args.resolution * n / 1000, "igraph", 0, partition,
                                split=args.split, keys=torch.randn(n, 128, generator=torch.Generator().manual_seed(seed)).bfloat16())
                    for seed in range(args.workers)]
            done = [job.result() for job in jobs]
            k = len(done)
            print(f"n={n}: {k} graphs in {time.perf_counter() - tic:.1f} s wall; per graph: build {sum(d.graph_seconds for d in done) / k:.2f} s, "
                  f"Leiden {sum(d.partition_seconds for d in done) / k:.2f} s, split {sum(d.split_seconds for d in done) / k:.2f} s, "
                  f"{sum(int(d.membership.max()) + 1 for d in done) / k:.0f} parts", flush=True)


if __name__ == "__main__":
    main()
