"""Contract tests of `policyzoo.kv.Window` (sinks + local window)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.kv import Window

SETTINGS = settings(max_examples=50, deadline=None)


@SETTINGS
@given(data=st.data(), sinks=st.integers(0, 8), window=st.integers(1, 40))
def test_window_contract(data, cases, contract, sinks, window):
    case = data.draw(cases())
    sel = Window(sinks=sinks, window=window).select(case.state(), case.q)
    assert sel.block == 1 and sel.log_weight is None
    contract.check_entries(sel, case, sinks, window)
    # exactly the forced tokens, nothing else, the same for every KV head
    for r in range(case.b):
        for hk in range(case.h_kv):
            assert set(contract.selected(sel, r, hk)) == case.forced_tokens(r, sinks, window)
    contract.check_budget(sel, case, sinks + window, sinks, window)
    contract.check_error_bound(sel, case)


@SETTINGS
@given(data=st.data(), sinks=st.integers(0, 8))
def test_window_covering_everything_is_dense(data, cases, contract, sinks):
    case = data.draw(cases())
    window = data.draw(st.integers(max(1, case.length - sinks), case.length + 10))
    sel = Window(sinks=sinks, window=window).select(case.state(), case.q)
    for r in range(case.b):
        for hk in range(case.h_kv):
            assert sorted(contract.selected(sel, r, hk)) == case.visible_tokens(r)
    contract.check_reproduces_dense(sel, case)


def test_window_hand_made(make_case, contract):
    # one row padded by 3: visible 3..11 (prompt 10, 2 decode steps)
    case = make_case(b=2, h_kv=1, g=2, d=8, page=4, prompt=10, steps=2, starts=[0, 3], seed=0)
    sel = Window(sinks=2, window=3).select(case.state(), case.q)
    assert sorted(contract.selected(sel, 0, 0)) == [0, 1, 9, 10, 11]
    assert sorted(contract.selected(sel, 1, 0)) == [3, 4, 9, 10, 11]
    sel = Window(sinks=0, window=1).select(case.state(), case.q)
    assert contract.selected(sel, 0, 0) == [11] and contract.selected(sel, 1, 0) == [11]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(sinks=-1), ValueError, "sinks"),
        (dict(window=0), ValueError, "window"),
        (dict(window=-3), ValueError, "window"),
        (dict(sinks=1.5), TypeError, "sinks"),
        (dict(window=2.0), TypeError, "window"),
        (dict(sinks=True), TypeError, "sinks"),
        (dict(window="8"), TypeError, "window"),
    ],
)
def test_window_rejects_bad_args(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        Window(**kwargs)
