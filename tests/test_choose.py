"""Contract tests of `policyzoo.kv.choose`: `choose_topk` (forced entries first, the best scores, counts
capped by the valid entries and the width, ties lowest position first at bf16 precision, the fused
and the stepwise paths alike) and the candidate budget of two-stage selection."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo import kernels
from policyzoo.kv.choose import candidate_budget, choose_topk, choose_topk_steps, round_for_ranking

SETTINGS = settings(max_examples=50, deadline=None)
INF = math.inf


def _sel_sets(sel):
    return [[set(sel.indices[b, h, : int(sel.count[b, h])].tolist()) for h in range(sel.count.shape[1])] for b in range(sel.count.shape[0])]


# ------------------------------------------------------------------------------------ chooser
def test_choose_topk_best_scores():
    scores = torch.tensor([[[3.0, 1.0, 2.0, -INF, 5.0]]])
    sel = choose_topk(scores, torch.zeros(1, 5, dtype=torch.bool), 3, torch.tensor([2]))
    assert sel.count.tolist() == [[2]] and sel.count.dtype == torch.int32 and sel.indices.dtype == torch.int32
    assert sel.indices.shape == (1, 1, 3) and sel.block == 1
    assert _sel_sets(sel) == [[{4, 0}]]


def test_choose_topk_forced_outrank_scores():
    scores = torch.tensor([[[3.0, -7.0, 2.0, 0.0, 5.0]]])
    forced = torch.tensor([[False, True, False, True, False]])
    sel = choose_topk(scores, forced, 4, torch.tensor([3]))
    assert _sel_sets(sel) == [[{1, 3, 4}]]
    # count is raised to the number of forced entries
    sel = choose_topk(scores, forced, 4, torch.tensor([1]))
    assert _sel_sets(sel) == [[{1, 3}]]
    sel = choose_topk(scores, forced, 4, torch.tensor([0]))
    assert _sel_sets(sel) == [[{1, 3}]]


def test_choose_topk_forced_invalid_entry_is_not_selected():
    scores = torch.tensor([[[1.0, -INF, 2.0]]])
    forced = torch.tensor([[False, True, False]])
    sel = choose_topk(scores, forced, 3, torch.tensor([1]))
    # the forced entry is invalid (-inf): it is neither selected nor counted
    assert _sel_sets(sel) == [[{2}]]


def test_choose_topk_ranks_rows_longer_than_one_program_in_bf16_exactly(monkeypatch):
    """In the steps (`choose_topk_steps`: rows longer than the fused kernel takes), rows over
    `kernels.SELECT_TOP_ROW` entries go to `select_top` in bf16: the same entries as ranking the fp32
    scores, since both are ranked at bf16 precision (ties by position); and the same as `choose_topk`."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 3, 300, generator=g) * 4
    scores[0, 1, ::7] = -INF
    forced = torch.zeros(2, 300, dtype=torch.bool)
    forced[:, :4] = True
    count = torch.tensor([40, 120])
    seen = []
    real = kernels.select_top
    monkeypatch.setattr(kernels, "select_top", lambda s, *a, **kw: seen.append(s.dtype) or real(s, *a, **kw))
    short = choose_topk_steps(scores, forced, 128, count)
    monkeypatch.setattr(kernels, "SELECT_TOP_ROW", 64)
    long = choose_topk_steps(scores, forced, 128, count)
    assert seen == [torch.float32, torch.bfloat16]
    assert torch.equal(long.indices, short.indices) and torch.equal(long.count, short.count)
    fused = choose_topk(scores, forced, 128, count)
    assert torch.equal(fused.indices, short.indices) and torch.equal(fused.count, short.count)


def test_choose_topk_count_capped_by_valid_and_width():
    scores = torch.tensor([[[-INF, 4.0, -INF, 1.0, -INF, -INF]]])
    none = torch.zeros(1, 6, dtype=torch.bool)
    sel = choose_topk(scores, none, 5, torch.tensor([5]))
    assert sel.count.tolist() == [[2]] and _sel_sets(sel) == [[{1, 3}]]
    scores = torch.arange(6.0).view(1, 1, 6)
    sel = choose_topk(scores, none, 2, torch.tensor([5]))
    assert sel.count.tolist() == [[2]] and _sel_sets(sel) == [[{5, 4}]]
    # all invalid -> empty selection
    sel = choose_topk(torch.full((1, 1, 4), -INF), none[:, :4], 2, torch.tensor([2]))
    assert sel.count.tolist() == [[0]]


def test_choose_topk_ties():
    scores = torch.tensor([[[1.0, 1.0, 1.0, 1.0, 0.5]]])
    sel = choose_topk(scores, torch.zeros(1, 5, dtype=torch.bool), 3, torch.tensor([2]))
    (got,) = _sel_sets(sel)[0]
    assert int(sel.count[0, 0]) == 2 and len(got) == 2 and got <= {0, 1, 2, 3}
    # ties with -inf around and a forced tie member
    scores = torch.tensor([[[2.0, -INF, 2.0, 2.0]]])
    forced = torch.tensor([[False, False, True, False]])
    sel = choose_topk(scores, forced, 4, torch.tensor([2]))
    (got,) = _sel_sets(sel)[0]
    assert 2 in got and len(got) == 2 and got <= {0, 2, 3}


def test_choose_topk_per_row_counts_and_heads():
    scores = torch.tensor(
        [
            [[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]],
            [[5.0, -INF, 1.0, 2.0], [1.0, -INF, 5.0, 2.0]],
        ]
    )
    forced = torch.tensor([[True, False, False, False], [False, False, False, True]])
    sel = choose_topk(scores, forced, 3, torch.tensor([2, 3]))
    assert sel.count.tolist() == [[2, 2], [3, 3]]
    assert _sel_sets(sel) == [[{0, 3}, {0, 1}], [{3, 0, 2}, {3, 2, 0}]]


@SETTINGS
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    n=st.integers(1, 20),
    data=st.data(),
)
def test_choose_topk_properties(b, h, n, data):
    vals = st.one_of(st.just(-INF), st.integers(-3, 3).map(float))  # many ties and -inf
    scores = torch.tensor(data.draw(st.lists(vals, min_size=b * h * n, max_size=b * h * n))).view(b, h, n)
    forced = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))).view(b, n)
    k_max = data.draw(st.integers(1, n))
    count = torch.tensor(data.draw(st.lists(st.integers(0, n + 2), min_size=b, max_size=b)))
    sel = choose_topk(scores, forced, k_max, count)
    assert sel.indices.shape == (b, h, k_max)
    for r in range(b):
        for hk in range(h):
            got = sel.indices[r, hk, : int(sel.count[r, hk])].tolist()
            valid = {i for i in range(n) if scores[r, hk, i] > -INF}
            f = {i for i in range(n) if forced[r, i]} & valid
            want = min(max(int(count[r]), len(f)), k_max, len(valid))
            assert len(got) == want and len(set(got)) == len(got)
            assert set(got) <= valid
            if len(f) <= k_max:
                assert f <= set(got)
            free = set(got) - f
            rest = valid - set(got)
            if free and rest:
                assert min(float(scores[r, hk, i]) for i in free) >= max(float(scores[r, hk, i]) for i in rest)

@pytest.mark.parametrize("factor", [1, 2, 3, 2.5, 1.25, 3.0])
def test_candidate_budget_widens_by_the_factor_within_the_pages(factor):
    count = torch.tensor([[0, 1, 4], [7, 10, 3]])
    wide, wide_count = candidate_budget(10, count, factor, n_pages=24)
    assert wide == min(24, math.ceil(factor * 10)) and wide_count.dtype == torch.int64
    assert wide_count.tolist() == [[min(wide, math.ceil(factor * c)) for c in row] for row in count.tolist()]


@SETTINGS
@given(factor=st.floats(1.0, 8.0), k_max=st.integers(1, 500), n_pages=st.integers(1, 2000))
def test_candidate_budget_keeps_at_least_the_kept_pages(factor, k_max, n_pages):
    """Any factor >= 1 (taken as a fraction of denominator <= 64): never fewer candidates than kept
    pages, never more than the cache's pages, and within 2% of ``factor`` times the budget."""
    k_max = min(k_max, n_pages)
    count = torch.arange(k_max + 1)
    wide, wide_count = candidate_budget(k_max, count, factor, n_pages)
    assert k_max <= wide <= n_pages and bool((wide_count >= count).all()) and bool((wide_count <= wide).all())
    assert wide >= min(n_pages, math.ceil(factor * k_max / 1.02))



@SETTINGS
@given(st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=64))
def test_ranking_rounds_to_bf16_precision_monotonically(values):
    x = torch.tensor(values, dtype=torch.float32)
    r = round_for_ranking(x)
    finite = torch.isfinite(x) & (x.abs() < 3e38)  # the largest floats round up to inf
    assert torch.equal(torch.isinf(r[torch.isinf(x)]), torch.ones_like(r[torch.isinf(x)], dtype=torch.bool))
    # 8 significant bits (subnormals: half a bf16 subnormal step)
    assert bool(((r[finite] - x[finite]).abs() <= (x[finite].abs() * 2.0**-8).clamp(min=2.0**-134)).all())
    order = torch.sort(x).indices
    assert bool((r[order][1:] >= r[order][:-1]).all())  # rounding never swaps two scores


def test_ranking_rounds_the_same_compiled_and_eager():
    x = torch.randn(4, 1000) * 3
    x = torch.where(torch.rand(4, 1000) < 0.1, torch.inf, x)
    assert torch.equal(torch.compile(round_for_ranking)(x), round_for_ranking(x))


def test_choose_topk_treats_scores_equal_up_to_rounding_as_ties_lowest_position_first():
    scores = torch.tensor([[[1.0, 4.0 - 2e-6, 4.0, 4.0 + 2e-6, 4.0 - 1e-6, 0.5]]])
    none = torch.zeros(1, 6, dtype=torch.bool)
    sel = choose_topk(scores, none, 2, torch.tensor([2]))
    assert sel.indices.tolist() == [[[1, 2]]]
    compiled = torch.compile(choose_topk)(scores, none, 2, torch.tensor([2]))
    assert torch.equal(compiled.indices, sel.indices)
