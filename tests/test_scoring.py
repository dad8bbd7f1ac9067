"""Contract tests of `policyzoo.kv.scoring`: GQA aggregation, the forced sinks and window (whole rows
and at given slots), gathered logits, and the scores and bounds a `KVState` gives."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo import kernels
from policyzoo.kernels import reference
from policyzoo.kv.scoring import (
    aggregate_groups,
    exact_scores,
    forced_at,
    forced_pages,
    forced_tokens,
    group_page_bounds,
    page_bound_scores,
)

SETTINGS = settings(max_examples=50, deadline=None)
INF = math.inf



# ---------------------------------------------------------------------------- GQA aggregation
def test_aggregate_max_and_sum_by_hand():
    # B=1, H=4 query heads, H_kv=2 -> groups (0, 1) and (2, 3); N=3, entry 2 invalid
    scores = torch.tensor([[[0.0, 1.0, 9.0], [2.0, 0.0, 9.0], [0.0, 0.0, 9.0], [-1.0, 3.0, 9.0]]])
    valid = torch.tensor([[True, True, False]])
    out = aggregate_groups(scores, valid, 2, "max")
    assert out.tolist() == [[[2.0, 1.0, -INF], [0.0, 3.0, -INF]]]
    out = aggregate_groups(scores, valid, 2, "sum")
    p = lambda a, b: math.exp(a) / (math.exp(a) + math.exp(b))  # noqa: E731
    want = [[p(0, 1) + p(2, 0), p(1, 0) + p(0, 2), -INF], [0.5 + p(-1, 3), 0.5 + p(3, -1), -INF]]
    torch.testing.assert_close(out, torch.tensor([want]))


def test_aggregate_all_invalid_row_is_minus_inf_without_nan():
    scores = torch.randn(2, 4, 5)
    valid = torch.tensor([[False] * 5, [True, False, True, False, False]])
    for how in ("sum", "max"):
        out = aggregate_groups(scores, valid, 2, how)
        assert not torch.isnan(out).any()
        assert bool((out[0] == -INF).all())
        assert bool(torch.isfinite(out[1][:, [0, 2]]).all()) and bool((out[1][:, [1, 3, 4]] == -INF).all())


def test_aggregate_ignores_invalid_scores():
    """Huge logits on invalid entries must not steal softmax mass."""
    scores = torch.tensor([[[0.0, 0.0, 1e4]]])
    valid = torch.tensor([[True, True, False]])
    out = aggregate_groups(scores, valid, 1, "sum")
    torch.testing.assert_close(out[0, 0, :2], torch.tensor([0.5, 0.5]))


def test_aggregate_bad_how():
    with pytest.raises(ValueError, match="aggregate"):
        aggregate_groups(torch.zeros(1, 2, 3), torch.ones(1, 3, dtype=torch.bool), 1, "mean")


@SETTINGS
@given(b=st.integers(1, 3), h_kv=st.integers(1, 3), g=st.integers(1, 4), n=st.integers(1, 12), data=st.data())
def test_aggregate_properties(b, h_kv, g, n, data):
    seed = data.draw(st.integers(0, 2**16))
    scores = torch.randn(b, h_kv * g, n, generator=torch.Generator().manual_seed(seed)) * 4
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))).view(b, n)
    s = scores.view(b, h_kv, g, n)
    mx = aggregate_groups(scores, valid, h_kv, "max")
    sm = aggregate_groups(scores, valid, h_kv, "sum")
    for out in (mx, sm):
        assert out.shape == (b, h_kv, n) and not torch.isnan(out).any()
        assert bool((out[~valid[:, None, :].expand_as(out)] == -INF).all())
    v = valid[:, None, :].expand(b, h_kv, n)
    torch.testing.assert_close(mx[v], s.amax(2)[v])
    # each group's softmax masses sum to G over the valid entries (rows with any valid entry)
    total = sm.masked_fill(~v, 0.0).sum(-1)
    has = valid.any(-1)[:, None].expand(b, h_kv)
    torch.testing.assert_close(total[has], torch.full_like(total[has], float(g)))


# --------------------------------------------------------------------- scorers, forced entries
@SETTINGS
@given(data=st.data(), sinks=st.integers(0, 10), window=st.integers(0, 30))
def test_forced_tokens_and_pages(data, cases, sinks, window):
    case = data.draw(cases())
    state = case.state()
    ft = forced_tokens(state, sinks, window)
    fp = forced_pages(state, sinks, window)
    assert ft.shape == (case.b, case.cache.capacity) and fp.shape == (case.b, case.cache.num_pages)
    for r in range(case.b):
        assert set(torch.nonzero(ft[r]).flatten().tolist()) == case.forced_tokens(r, sinks, window)
        assert set(torch.nonzero(fp[r]).flatten().tolist()) == case.forced_pages(r, sinks, window)
        assert (case.length - 1) // case.page in case.forced_pages(r, sinks, window)


@SETTINGS
@given(data=st.data(), sinks=st.integers(0, 10), window=st.integers(0, 30), picks=st.integers(1, 40))
def test_flags_at_slots_equal_the_full_rows(data, cases, sinks, window, picks):
    """`visible_at` and `forced_at` read a few slots without a capacity-sized tensor: the same flags
    as gathering from `token_valid` and `forced_tokens`."""
    case = data.draw(cases())
    state = case.state()
    g = torch.Generator().manual_seed(picks)
    slots = torch.randint(case.cache.capacity, (case.b, case.h_kv, picks), generator=g)
    rows = lambda full: torch.gather(full[:, None, :].expand(-1, case.h_kv, -1), 2, slots)  # noqa: E731
    assert torch.equal(case.cache.visible_at(slots), rows(state.token_valid()))
    assert torch.equal(forced_at(state, slots, sinks, window), rows(forced_tokens(state, sinks, window)))


@SETTINGS
@given(data=st.data(), picks=st.integers(1, 40))
def test_gathered_logits_are_the_exact_logits_at_the_slots(data, cases, picks):
    case = data.draw(cases())
    state = case.state()
    slots = torch.randint(case.cache.capacity, (case.b, case.h_kv, picks), generator=torch.Generator().manual_seed(picks))
    got = kernels.gathered_logits(case.q, state.keys, slots, state.scale)
    full = exact_scores(state, case.q).view(case.b, case.h_kv, case.g, -1)
    want = torch.gather(full, 3, slots[:, :, None, :].expand(-1, -1, case.g, -1))
    assert got.dtype == torch.float32 and got.shape == (case.b, case.h_kv, case.g, picks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # two fp32 matmul orders



@SETTINGS
@given(data=st.data())
def test_state_and_scorers(data, cases):
    case = data.draw(cases())
    state = case.state()
    c = case.cache
    assert state.num_valid().tolist() == [case.n_valid(r) for r in range(case.b)]
    assert torch.equal(state.token_valid(), case.token_valid())
    for r in range(case.b):
        assert torch.nonzero(state.page_valid()[r]).flatten().tolist() == case.visible_pages(r)
    s = exact_scores(state, case.q)
    qg = case.q.double().view(case.b, case.h_kv, case.g, case.d)
    want = (torch.einsum("bkgd,bknd->bkgn", qg, c.keys[0].double()) * case.scale).reshape(case.b, case.h, -1)
    assert s.dtype == torch.float32 and s.shape == (case.b, case.h, c.capacity)
    torch.testing.assert_close(s.double(), want, rtol=1e-4, atol=1e-4)
    pb = page_bound_scores(state, case.q)
    assert pb.shape == (case.b, case.h, c.num_pages)
    torch.testing.assert_close(pb, reference.quest_page_bound(case.q, c.page_min[0], c.page_max[0], case.scale))
    # The group fold in the kernel is the max over the group's per-head bounds, -inf off the context.
    grouped = group_page_bounds(state, case.q)
    assert torch.equal(grouped, aggregate_groups(pb, state.page_valid(), case.h_kv, "max"))
