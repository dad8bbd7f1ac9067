"""Contract tests of `policyzoo.kv.community_graph`: the token graph a `CommunityKV` prefill builds from
each query's most attended keys, and its partition into communities.

What the module promises: the graph is undirected with each pair once (``lo < hi``), leaves the sinks
and self-edges out, and splits its weight ``1 - mix`` : ``mix`` between the attention edges and the
co-attention (each part normalised to its share); a job's communities are dense ids covering every
token, its strengths the tokens' weighted degrees; a split makes parts of at most ``split`` tokens
within each community, in the job; a partition function replaces Leiden and is checked; missing
optional packages say how to install them.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.kv.choose import round_for_ranking
from policyzoo.kv.community_graph import (
    SPLIT_ITERATIONS,
    ClusteringTime,
    _graph,
    _sources,
    graph_communities,
    require_leiden,
    split_communities,
)

SETTINGS = settings(max_examples=40, deadline=None)


def edges(seed: int, heads: int, queries: int, n: int, top: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random causal edges ``dst, p [heads, queries, top]`` as `kernels.attention_edges` gives them: query
    ``first + i`` has ``min(top, first + i + 1)`` distinct keys among ``0 .. first + i``, then ``p = 0``."""
    g = torch.Generator().manual_seed(seed)
    pos = first + torch.arange(queries)
    noise = torch.rand(heads, queries, n, generator=g).masked_fill(torch.arange(n) > pos[:, None], -1.0)
    dst = noise.argsort(-1, descending=True)[..., :top]  # distinct visible keys first
    dst = torch.nn.functional.pad(dst, (0, top - dst.shape[-1]))  # fewer keys than top: p = 0 there
    p = torch.rand(heads, queries, top, generator=g)
    p = torch.where(torch.arange(top)[None, None, :] <= pos[None, :, None], p, 0.0)
    return dst, p


@SETTINGS
@given(seed=st.integers(0, 2**16), queries=st.integers(1, 40), top=st.integers(1, 6), mix=st.sampled_from([0.0, 0.3, 1.0]),
       sinks=st.integers(0, 3))
def test_the_graph_is_undirected_each_pair_once_and_splits_its_weight_by_mix(seed, queries, top, mix, sinks):
    n = queries
    dst, p = edges(seed, 1, queries, n, top, 0)
    lo, hi, w = _graph(_sources(dst, 0), dst[0], p[0], n, mix, sinks)
    assert bool((lo < hi).all()) and bool((lo >= sinks).all()) and bool((hi < n).all())
    assert torch.unique(lo * n + hi).numel() == lo.numel()  # each pair once
    assert bool((w > 0).all())
    # Each part that has edges weighs its share; the total is 1 when both have edges.
    src = _sources(dst, 0)
    ok = (p[0] > 0) & (dst[0] >= sinks) & (src >= sinks)
    has_e = bool((ok & (src != dst[0])).any())
    has_c = bool((ok.sum(-1) >= 2).any())
    want = (1 - mix) * has_e * (mix < 1) + mix * has_c * (mix > 0)
    assert float(w.sum()) == pytest.approx(want, abs=1e-9)


@SETTINGS
@given(seed=st.integers(0, 2**16), heads=st.integers(1, 3), queries=st.integers(1, 30), extra=st.integers(0, 20),
       top=st.integers(1, 4), size=st.integers(1, 7))
def test_a_job_gives_dense_communities_over_every_token_and_their_weighted_degree(seed, heads, queries, extra, top, size):
    n = queries + extra  # the queries are the last tokens of the graph
    first = extra
    dst, p = edges(seed, heads, queries, n, top, first)
    runs = functools.partial(_runs, size=size)
    membership, strength, graph_s, part_s, split_s = graph_communities(n, first, dst, p, 0.5, 1, 1.0, "igraph", 0, runs)
    assert membership.shape == (n,) and membership.dtype == torch.int64
    assert set(membership.tolist()) == set(range(int(membership.max()) + 1))  # dense ids, none empty
    lo, hi, w = _graph(_sources(dst, first), dst.flatten(0, 1), p.flatten(0, 1), n, 0.5, 1)
    degree = torch.zeros(n, dtype=torch.float64).index_add_(0, lo, w).index_add_(0, hi, w)
    torch.testing.assert_close(strength, degree)
    assert graph_s >= 0 and part_s >= 0 and split_s >= 0


@SETTINGS
@given(seed=st.integers(0, 2**16), queries=st.integers(1, 30), size=st.integers(1, 9), most=st.integers(1, 5), d=st.integers(1, 6))
def test_a_job_with_a_split_gives_the_partition_split_by_the_keys(seed, queries, size, most, d):
    dst, p = edges(seed, 2, queries, queries, 3, 0)
    runs = functools.partial(_runs, size=size)
    keys = torch.randn(queries, d, generator=torch.Generator().manual_seed(seed)).bfloat16()
    whole = graph_communities(queries, 0, dst, p, 0.5, 1, 1.0, "igraph", 0, runs)
    parts = graph_communities(queries, 0, dst, p, 0.5, 1, 1.0, "igraph", 0, runs, split=most, keys=keys)
    assert torch.equal(parts.membership, split_communities(whole.membership, keys, most))
    assert torch.equal(parts.strength, whole.strength)
    assert int(torch.bincount(parts.membership).max()) <= most


def test_a_split_without_the_graphs_keys_is_refused():
    dst, p = edges(0, 1, 5, 5, 2, 0)
    for keys in (None, torch.zeros(4, 2)):
        with pytest.raises(ValueError, match="keys"):
            graph_communities(5, 0, dst, p, 0.5, 0, 1.0, "igraph", 0, functools.partial(_runs, size=2), split=2, keys=keys)


def _runs(n, lo, hi, weight, gamma, seed, size):
    return torch.arange(n) // size * 7  # sparse ids on purpose: the job makes them dense


@pytest.mark.parametrize("answer, match", [(lambda n: torch.zeros(n + 1, dtype=torch.long), "n="),
                                           (lambda n: torch.full((n,), -1), ">= 0"),
                                           (lambda n: torch.zeros(n), "integer")])
def test_a_partition_function_that_answers_wrong_is_refused(answer, match):
    dst, p = edges(0, 1, 5, 5, 2, 0)
    with pytest.raises(ValueError, match=match):
        graph_communities(5, 0, dst, p, 0.5, 0, 1.0, "igraph", 0, lambda n, *rest: answer(n))


def test_leiden_sees_the_graph_the_constructor_would_build():
    """The graph goes to igraph through ``add_edges`` (fast), and Leiden partitions it exactly as a
    graph built by ``igraph.Graph(n, edges=...)``."""
    import random

    igraph = pytest.importorskip("igraph")
    n = 300
    dst, p = edges(3, 2, n, n, 4, 0)
    lo, hi, w = _graph(_sources(dst, 0), dst.flatten(0, 1).long(), p.flatten(0, 1), n, 0.5, 1)
    membership, *_ = graph_communities(n, 0, dst, p, 0.5, 1, 1.0, "igraph", 7, None)
    igraph.set_random_number_generator(random.Random(7))
    try:
        g = igraph.Graph(n=n, edges=torch.stack([lo, hi], 1).tolist())
        want = g.community_leiden(objective_function="modularity", weights=w.tolist(), resolution=1.0, n_iterations=2).membership
    finally:
        igraph.set_random_number_generator(random)
    assert membership.tolist() == want


def test_leiden_partitions_two_cliques_apart():
    """Two groups of tokens that only attend within themselves become (at least) two communities, never mixed."""
    n, half = 20, 10
    pos = torch.arange(n)
    dst = torch.stack([torch.where(pos < half, (pos + k) % half, half + (pos - half + k) % half) for k in (1, 2, 3)], -1)
    p = torch.full((1, n, 3), 0.3)
    membership, *_ = graph_communities(n, 0, dst[None], p, 0.5, 0, 1.0, "igraph", 0, None)
    assert not set(membership[:half].tolist()) & set(membership[half:].tolist())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), d=st.integers(1, 8), communities=st.integers(1, 6), most=st.integers(1, 10), seed=st.integers(0, 2**31 - 1),
       same=st.booleans())  # fmt: skip
def test_a_split_makes_parts_of_at_most_split_tokens_within_each_community(n, d, communities, most, seed, same):
    """Every part lies in one community; a community of at most ``most`` tokens is one part; a larger
    one is cut into parts of at most ``most`` tokens, each at least ``(most + 1) // 2`` (halves of
    halves); the ids are dense; and the split depends on the keys alone (ties, e.g. equal keys, by
    position)."""
    gen = torch.Generator().manual_seed(seed)
    member = torch.unique(torch.randint(0, communities, (n,), generator=gen), return_inverse=True)[1]
    keys = torch.ones(n, d) if same else torch.randn(n, d, generator=gen)
    parts = split_communities(member, keys, most)
    assert parts.shape == member.shape and parts.dtype == torch.long
    sizes = torch.bincount(parts)
    assert int(parts.max()) + 1 == sizes.shape[0] and bool((sizes > 0).all())  # dense ids, none empty
    assert int(sizes.max()) <= most
    for part in range(sizes.shape[0]):
        assert len(set(member[parts == part].tolist())) == 1, "a part within one community"
    for c, size in enumerate(torch.bincount(member).tolist()):
        inside = parts[member == c].unique()
        if size <= most:
            assert len(inside) == 1
        else:
            assert all(int(sizes[p]) >= (most + 1) // 2 for p in inside)
    assert torch.equal(split_communities(member, keys, most), parts)


def _split_every_token(member, keys, most):
    """The split as first written: every round over all tokens (the small communities' sums made
    and unused). `split_communities` works on the large ones only and must give the same parts."""
    keys = round_for_ranking(keys.float()).double()
    while True:
        sizes = torch.bincount(member)
        big = sizes[member] > most
        if not bool(big.any()):
            return member
        mean = torch.zeros(sizes.shape[0], keys.shape[1], dtype=keys.dtype).index_add_(0, member, keys) / sizes.clamp(min=1)[:, None]
        x = keys - mean[member]
        axis = torch.zeros_like(mean).index_add_(0, member, x.abs())
        for _ in range(SPLIT_ITERATIONS):
            axis = torch.zeros_like(mean).index_add_(0, member, (x * axis[member]).sum(-1, keepdim=True) * x)
            axis = axis / axis.norm(dim=-1, keepdim=True).clamp(min=1e-30)
        by_projection = torch.argsort((x * axis[member]).sum(-1), stable=True)
        grouped = by_projection[torch.argsort(member[by_projection], stable=True)]
        rank = torch.empty_like(member)
        rank[grouped] = torch.arange(member.shape[0]) - (sizes.cumsum(0) - sizes)[member[grouped]]
        member = torch.unique(member * 2 + (big & (rank >= sizes[member] // 2)).long(), return_inverse=True)[1]


@SETTINGS
@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), most=st.integers(1, 6), skew=st.floats(0.5, 3.0))
def test_the_split_works_on_the_large_communities_only_and_gives_the_same_parts(seed, n, most, skew):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(max(n // 3, 1), generator=gen) ** (4 * skew)  # a few large communities, many small
    member = torch.unique(torch.multinomial(weights, n, replacement=True, generator=gen), return_inverse=True)[1]
    keys = torch.randn(n, 5, generator=gen)
    assert torch.equal(split_communities(member, keys, most), _split_every_token(member, keys, most))


@pytest.mark.parametrize("leiden, missing", [("igraph", "igraph"), ("leidenalg", "leidenalg")])
def test_a_missing_extra_says_how_to_install_it(monkeypatch, leiden, missing):
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ImportError, match=r"policyzoo\[community\]"):
        require_leiden(leiden)


def test_clustering_time_per_1k_tokens():
    t = ClusteringTime(graph_seconds=3.0, leiden_seconds=1.5, tokens=500)
    assert t.per_1k_tokens() == (6.0, 3.0)
    assert ClusteringTime().per_1k_tokens() == (0.0, 0.0)  # no tokens yet: no division by zero
