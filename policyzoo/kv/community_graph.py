"""The token graph of a `CommunityKV` prefill and its partition into communities.

Per batch row and graph, a token graph of the prompt:

- ``E``: an edge from each query to each of its ``top`` most attended keys (causal, visible, sinks
  left out: they are always kept, and as hubs every query attends to they would chain everything into
  one community), weighted by the attention probability; self-edges dropped;
- ``C``, the co-attention of keys: keys ``j, k`` in the same query's top ``top`` are joined with
  weight ``p_j · p_k``, summed over the queries;
- ``W = (1 - mix) · sym(E) / ΣE + mix · C / ΣC``: both undirected (``sym(E) = E + Eᵀ``) and each
  normalised to a total edge weight of one, so ``mix`` is the share of the graph's weight that comes
  from co-attention, whatever the prompt length or the attention's sharpness.

``graph="group"`` builds one graph per KV head from the edges of its GQA group's query heads (their
``E`` and ``C`` summed); ``graph="head"`` one graph per query head. The probabilities are rounded to
bf16 precision, so that a row builds the same graph alone and in a padded batch (where its keys
differ in the last bits).

Each graph is partitioned by Leiden on the RB-configuration quality (modularity with a resolution,
``resolution`` per 1,000 tokens of the graph), with a fixed ``seed``: by igraph's C implementation
(``Graph.community_leiden``, the default) or by ``leidenalg.find_partition``. Both reach the same
quality on SmolLM2's graphs (within 0.3%); igraph's took 0.04 s per graph of 3K tokens where
leidenalg's took 0.7-1.7 s. A ``partition`` function replaces Leiden (a GPU Leiden, or a fixed
partition for timing): it gets each graph as edge tensors.

Communities larger than ``split`` tokens are then halved along their keys' principal axis until no
part is larger (`split_communities`; `CommunityKV`'s module docstring says why), in the same job.

The prefill of a layer finds the edges on the model's device and hands the graphs to ``workers``
processes (threads would not do: leidenalg holds the GIL, and igraph draws its random numbers from a
process-wide Python generator); the forward goes on to the next layer meanwhile, and
`CommunityKV.finish_prefill`, after the forward, waits for every layer's partitions. Each
graph reseeds the generator, so the partition does not depend on which process made it. The time the
prefills take is recorded in a `ClusteringTime`.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple

import torch
from torch import Tensor

from .choose import round_for_ranking

# partition(n, lo, hi, weight, gamma, seed) -> membership int64[n]: one graph's communities (see
# `CommunityKV.partition`).
Partition = Callable[[int, Tensor, Tensor, Tensor, float, int], Tensor]
Leiden = Literal["igraph", "leidenalg"]
LEIDENS = ("igraph", "leidenalg")

# Power iterations for a part's principal axis (`split_communities`): the split only needs its rough direction.
SPLIT_ITERATIONS = 8

_INSTALL = 'CommunityKV partitions its token graphs with leidenalg and python-igraph: pip install "policyzoo[community]"'


def require_leiden(which: str) -> tuple[Any, Any]:
    """``(igraph, leidenalg or None)``, imported on first use (they are an optional extra);
    ``leidenalg`` only when ``which`` is ``"leidenalg"``."""
    try:
        import igraph

        leidenalg = importlib.import_module("leidenalg") if which == "leidenalg" else None
    except ImportError as e:
        raise ImportError(_INSTALL) from e
    return igraph, leidenalg


@dataclass
class ClusteringTime:
    """Time the prefills spent on communities, all layers and graphs together: finding the edges
    and building the graphs (``graph_seconds``), partitioning them (``leiden_seconds``) and splitting
    the communities into parts (``split_seconds``), summed over the processes that did it;
    ``wait_seconds``, the wall time the session spent after the
    prompt's forward waiting for the partitions and laying them out (what parallel workers leave of
    the work). ``tokens``: the prompt tokens (rows × visible tokens) covered."""

    graph_seconds: float = 0.0
    leiden_seconds: float = 0.0
    split_seconds: float = 0.0
    wait_seconds: float = 0.0
    tokens: int = 0
    graphs: int = 0

    def per_1k_tokens(self) -> tuple[float, float]:
        """``(graph, leiden)`` seconds per 1,000 prompt tokens, all layers together."""
        per = 1000 / max(self.tokens, 1)
        return self.graph_seconds * per, self.leiden_seconds * per



class Communities(NamedTuple):
    """One graph's partition (`graph_communities`): community ids ``membership int64[n]`` (dense,
    after the split), each token's weighted degree ``strength float64[n]``, and the seconds spent."""

    membership: Tensor
    strength: Tensor
    graph_seconds: float
    partition_seconds: float
    split_seconds: float


def graph_communities(n: int, first: int, dst: Tensor, p: Tensor, mix: float, sinks: int, gamma: float, which: str, seed: int,
                      partition: Partition | None, *, split: int = 0, keys: Tensor | None = None) -> Communities:
    """One graph's communities (a job, run in a worker process or in place) for the edges ``dst, p
    [heads, Q, top]`` of queries ``first, first + 1, ...`` (`CommunityKV._edges`), summed into the
    graph by `_graph` and partitioned at RB-configuration resolution ``gamma``: by ``partition``
    where given, else by Leiden (`_partition`; igraph building its graph counts as graph seconds).
    ``strength``: each token's weighted degree. With ``split`` > 0 the communities are split into
    parts of at most ``split`` tokens by their ``keys [n, D]`` (`split_communities`)."""
    if split and (keys is None or keys.shape[0] != n):
        raise ValueError(f"a split into parts of {split} tokens needs the graph's keys [n={n}, D]")
    tic = time.perf_counter()
    lo, hi, w = _graph(_sources(dst, first), dst.flatten(0, 1).long(), p.flatten(0, 1), n, mix, sinks)
    strength = torch.zeros(n, dtype=torch.float64).index_add_(0, lo, w).index_add_(0, hi, w)
    graph_s = time.perf_counter() - tic
    if partition is not None:
        tic = time.perf_counter()
        membership = _checked(partition(n, lo, hi, w, gamma, seed), n)
        partition_s = time.perf_counter() - tic
    else:
        membership, build_s, partition_s = _partition(n, lo, hi, w, gamma, which, seed)
        graph_s += build_s
    tic = time.perf_counter()
    if split:
        membership = split_communities(membership, keys, split)
    return Communities(membership, strength, graph_s, partition_s, time.perf_counter() - tic)


def _projection(x: Tensor, axis: Tensor, part: Tensor, per_token: Tensor, out: Tensor) -> Tensor:
    """``out [n, 1]``: each token's ``x [n, D]`` along its part's ``axis [P, D]`` (``part int64[n]``),
    through the scratch ``per_token`` (``x``'s shape)."""
    torch.index_select(axis, 0, part, out=per_token)
    return torch.sum(torch.mul(x, per_token, out=per_token), -1, keepdim=True, out=out)


def split_communities(member: Tensor, keys: Tensor, most: int) -> Tensor:
    """``member int64[n]`` (community ids ``0 .. C-1`` of ``n`` tokens) refined so that no community
    has more than ``most`` tokens: each larger one is halved at the median of its keys' (``keys [n, D]``)
    projection on their principal axis, again until none is larger; dense ids, each part within one
    community. The axis is found by power iteration on the centred keys (rounded to bf16 precision,
    so that a row is split alike alone and in a padded batch), all communities at once."""
    member = member.clone()
    keys = round_for_ranking(keys.float()).double()
    while True:
        big = torch.bincount(member)[member] > most
        if not bool(big.any()):
            return member
        # Only the tokens of communities still too large: each community's sums see its tokens in
        # the same order as over all tokens, so the halves are the same, for less work each round.
        at = big.nonzero().squeeze(1)
        _, part, sizes = torch.unique(member[at], return_inverse=True, return_counts=True)
        x = keys[at]
        # The token-sized intermediates go to buffers made once a round: a fresh tensor the size of
        # the keys costs more in page faults than its arithmetic (the same operations, so the same bits).
        per_token, along = torch.empty_like(x), torch.empty(x.shape[0], 1, dtype=x.dtype)
        mean = torch.zeros(sizes.shape[0], keys.shape[1], dtype=keys.dtype).index_add_(0, part, x) / sizes[:, None]
        x.sub_(torch.index_select(mean, 0, part, out=per_token))  # centred
        axis = torch.zeros_like(mean).index_add_(0, part, torch.abs(x, out=per_token))  # a share of every direction
        for _ in range(SPLIT_ITERATIONS):
            _projection(x, axis, part, per_token, along)
            axis = torch.zeros_like(mean).index_add_(0, part, torch.mul(along, x, out=per_token))
            axis = axis / axis.norm(dim=-1, keepdim=True).clamp(min=1e-30)
        by_projection = torch.argsort(_projection(x, axis, part, per_token, along).squeeze(1), stable=True)
        grouped = by_projection[torch.argsort(part[by_projection], stable=True)]  # by community, then along the axis
        rank = torch.empty_like(part)
        rank[grouped] = torch.arange(part.shape[0]) - (sizes.cumsum(0) - sizes)[part[grouped]]
        upper = torch.zeros_like(big)
        upper[at] = rank >= sizes[part] // 2
        member = torch.unique(member * 2 + upper.long(), return_inverse=True)[1]


def _checked(membership: Tensor, n: int) -> Tensor:
    """A `CommunityKV.partition` function's answer, as int64 community ids ``0 .. C-1`` (each used)."""
    if not isinstance(membership, (Tensor, list, tuple)) and type(membership).__module__ != "numpy":
        raise TypeError(f"a partition function must return n={n} integer community ids (a tensor), got {type(membership).__name__}")
    membership = torch.as_tensor(membership)
    if membership.shape != (n,) or membership.dtype.is_floating_point or membership.dtype == torch.bool:
        raise ValueError(f"a partition function must return n={n} integer community ids, got {membership.dtype} {tuple(membership.shape)}")
    if n and int(membership.min()) < 0:
        raise ValueError("a partition function's community ids must be >= 0")
    return torch.unique(membership.long(), return_inverse=True)[1]  # ids made dense: no empty community


def _sources(dst: Tensor, first: int) -> Tensor:
    """``[heads·Q, top]``: the query (local token index) each edge of ``dst [heads, Q, top]`` leaves."""
    heads, queries, top = dst.shape
    return (torch.arange(queries, device=dst.device) + first)[:, None].expand(queries, top).repeat(heads, 1)


def _partition(n: int, lo: Tensor, hi: Tensor, weight: Tensor, gamma: float, which: str, seed: int) -> tuple[Tensor, float, float]:
    """Leiden's ``membership int64[n]`` of the undirected graph of ``n`` tokens with edges ``lo[i] --
    hi[i]``, by igraph's C implementation or by leidenalg, reseeded for every graph (a partition does
    not depend on the graphs before it, nor on the process that makes it); and the seconds igraph
    took to build its graph and Leiden took to partition it."""
    igraph, leidenalg = require_leiden(which)
    tic = time.perf_counter()
    # add_edges takes the array whole; the constructor's ``edges=`` walks it edge by edge (the same
    # graph: 0.8 s against 2.9 s for 3.4 million edges).
    g = igraph.Graph(n=n)
    g.add_edges(torch.stack([lo, hi], 1).numpy())
    weights = weight.tolist()
    build_s = time.perf_counter() - tic
    tic = time.perf_counter()
    if leidenalg is not None:
        found = leidenalg.find_partition(
            g, leidenalg.RBConfigurationVertexPartition, weights=weights, resolution_parameter=gamma, seed=seed
        ).membership
    else:  # igraph draws from a Python random generator: a fresh one per graph, then the default again
        igraph.set_random_number_generator(random.Random(seed))
        try:
            found = g.community_leiden(objective_function="modularity", weights=weights, resolution=gamma, n_iterations=2).membership
        finally:
            igraph.set_random_number_generator(random)
    return torch.tensor(found, dtype=torch.long), build_s, time.perf_counter() - tic


def _graph(src: Tensor, dst: Tensor, p: Tensor, n: int, mix: float, sinks: int) -> tuple[Tensor, Tensor, Tensor]:
    """The undirected graph ``W = (1 - mix)·sym(E)/ΣE + mix·C/ΣC`` of ``n`` tokens from the edges
    ``src → dst`` of probability ``p`` (``[Q, top]``), as ``(lo, hi, weight)`` with ``lo < hi``, each
    pair once. Tokens before ``sinks`` take part in no edge."""
    ok = (p > 0) & (dst >= sinks) & (src >= sinks)
    e = ok & (src != dst)
    a, b = torch.triu_indices(p.shape[1], p.shape[1], 1, device=p.device)  # pairs of one query's top keys
    co = ok[:, a] & ok[:, b]
    pieces = []
    for lo, hi, w, share in (
        (src[e], dst[e], p[e].double(), 1.0 - mix),
        (dst[:, a][co], dst[:, b][co], (p[:, a].double() * p[:, b].double())[co], mix),
    ):
        total = float(w.sum())
        if share > 0 and total > 0:
            pieces.append((torch.minimum(lo, hi), torch.maximum(lo, hi), w * (share / total)))
    if not pieces:
        empty = torch.zeros(0, dtype=torch.long, device=p.device)
        return empty, empty, torch.zeros(0, dtype=torch.float64, device=p.device)
    lo, hi, w = (torch.cat(x) for x in zip(*pieces))
    pairs, which = torch.unique(lo * n + hi, return_inverse=True)
    weight = torch.zeros(pairs.shape[0], dtype=torch.float64, device=w.device).index_add_(0, which, w)
    return pairs // n, pairs % n, weight
