"""Contract tests of `policyzoo.kv.AttentionTopK` (exact attention scores, top entries + sinks/window)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.kv import AttentionTopK

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def topk_policies(draw):
    sinks = draw(st.integers(0, 6))
    window = draw(st.integers(0, 12))
    aggregate = draw(st.sampled_from(["sum", "max"]))
    if draw(st.booleans()):
        budget = draw(st.integers(max(1, sinks + window), sinks + window + 40))
    else:
        budget = draw(st.floats(1e-3, 1.0))
    return AttentionTopK(budget=budget, sinks=sinks, window=window, aggregate=aggregate)


def _group_scores(case, aggregate: str) -> torch.Tensor:
    """Independent per-KV-head scores ``[B, H_kv, N]`` (float64) over visible tokens."""
    c = case.cache
    qg = case.q.double().view(case.b, case.h_kv, case.g, case.d)
    logits = torch.einsum("bkgd,bknd->bkgn", qg, c.keys[0].double()) * case.scale
    tv = case.token_valid()[:, None, None, :]
    logits = logits.masked_fill(~tv, -torch.inf)
    if aggregate == "max":
        return logits.amax(2)
    return torch.softmax(logits, -1).sum(2)


@SETTINGS
@given(data=st.data(), policy=topk_policies())
def test_topk_contract(data, cases, contract, policy):
    case = data.draw(cases())
    sel = policy.select(case.state(), case.q)
    assert sel.block == 1 and sel.log_weight is None
    contract.check_entries(sel, case, policy.sinks, policy.window)
    contract.check_budget(sel, case, policy.budget, policy.sinks, policy.window)
    contract.check_error_bound(sel, case)


@SETTINGS
@given(data=st.data(), policy=topk_policies())
def test_topk_keeps_the_best_scores(data, cases, contract, policy):
    """Every kept non-forced token scores at least as high as every dropped visible token, at the
    precision the chooser ranks at (`round_for_ranking`: 8 significant bits)."""
    case = data.draw(cases())
    sel = policy.select(case.state(), case.q)
    scores = _group_scores(case, policy.aggregate)
    for r in range(case.b):
        forced = case.forced_tokens(r, policy.sinks, policy.window)
        visible = set(case.visible_tokens(r))
        for hk in range(case.h_kv):
            kept = set(contract.selected(sel, r, hk))
            free_kept = kept - forced
            dropped = visible - kept
            if free_kept and dropped:
                s = scores[r, hk]
                lo = min(float(s[i]) for i in free_kept)
                hi = max(float(s[i]) for i in dropped)
                assert lo >= hi - 2.0**-7 * abs(hi) - 1e-6, f"kept {lo} < dropped {hi}"  # one bf16 step


@SETTINGS
@given(
    data=st.data(),
    aggregate=st.sampled_from(["sum", "max"]),
    sinks=st.integers(0, 6),
    window=st.integers(0, 12),
    full=st.sampled_from(["ratio", "tokens"]),
)
def test_full_budget_is_dense(data, cases, contract, aggregate, sinks, window, full):
    case = data.draw(cases())
    budget = 1.0 if full == "ratio" else max(case.cache.capacity, sinks + window)
    sel = AttentionTopK(budget=budget, sinks=sinks, window=window, aggregate=aggregate).select(case.state(), case.q)
    for r in range(case.b):
        for hk in range(case.h_kv):
            assert sorted(contract.selected(sel, r, hk)) == case.visible_tokens(r)
    contract.check_reproduces_dense(sel, case)


def test_topk_hand_made(make_case, contract):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=12, steps=0, starts=[2], seed=3)
    c = case.cache
    # make key 6 aligned with the query, every other visible key orthogonal-ish and small
    c.keys[0][0, 0, 2:12] = 0.0
    c.keys[0][0, 0, 6] = case.q[0, 0] * 4
    sel = AttentionTopK(budget=4, sinks=1, window=2).select(case.state(), case.q)
    # sinks {2}, window {10, 11}, and the one free slot goes to the aligned key 6
    assert sorted(contract.selected(sel, 0, 0)) == [2, 6, 10, 11]
    # ratio budget 0.5 of 10 visible tokens -> 5 entries
    sel = AttentionTopK(budget=0.5, sinks=1, window=2).select(case.state(), case.q)
    assert int(sel.count[0, 0]) == 5 and {2, 6, 10, 11} <= set(contract.selected(sel, 0, 0))


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(budget=0), ValueError, "budget"),
        (dict(budget=-4), ValueError, "budget"),
        (dict(budget=0.0), ValueError, "budget"),
        (dict(budget=1.5), ValueError, "budget"),
        (dict(budget=float("nan")), ValueError, "budget"),
        (dict(budget=True), TypeError, "budget"),
        (dict(budget="0.5"), TypeError, "budget"),
        (dict(budget=100, sinks=-1), ValueError, "sinks"),
        (dict(budget=100, window=-1), ValueError, "window"),
        (dict(budget=100, sinks=2.0), TypeError, "sinks"),
        (dict(budget=100, window=None), TypeError, "window"),
        (dict(budget=10, sinks=4, window=8), ValueError, "budget"),
        (dict(aggregate="mean"), ValueError, "aggregate"),
    ],
)
def test_topk_rejects_bad_args(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        AttentionTopK(**kwargs)
