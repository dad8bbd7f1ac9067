"""Contract tests of `policyzoo.kv.Quest` (page min/max bound, top pages + sink/window pages)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.cache import PagedKVCache
from policyzoo.kernels import reference
from policyzoo.kv import KVState, Quest

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def quest_args(draw):
    sinks = draw(st.integers(0, 8))
    window = draw(st.integers(0, 20))
    aggregate = draw(st.sampled_from(["sum", "max"]))
    if draw(st.booleans()):
        budget = draw(st.integers(1, 80))
    else:
        budget = draw(st.floats(1e-3, 1.0))
    return dict(budget=budget, sinks=sinks, window=window, aggregate=aggregate)


@SETTINGS
@given(data=st.data(), args=quest_args(), bound=st.sampled_from(["box", "sketch"]))
def test_quest_contract(data, cases, contract, args, bound):
    case = data.draw(cases(sketch=(bound == "sketch",)))
    policy = Quest(page=case.page, bound=bound, **args)
    assert policy.page_size == case.page
    sel = policy.select(case.state(), case.q)
    assert sel.block == case.page and sel.log_weight is None
    contract.check_entries(sel, case, policy.sinks, policy.window, pages=True)
    contract.check_budget(sel, case, policy.budget, policy.sinks, policy.window, pages=True)
    contract.check_error_bound(sel, case)


@SETTINGS
@given(data=st.data(), args=quest_args(), kind=st.sampled_from(["box", "sketch"]))
def test_quest_keeps_the_best_bounds(data, cases, contract, args, kind):
    """Every kept non-forced page has a (group-aggregated) bound at least that of every dropped page,
    up to the ranking's bf16 precision (`choose_topk`: scores rounded to the same bf16 value tie, and
    two such scores differ by less than one bf16 step, at most 2^-7 of their size)."""
    case = data.draw(cases(sketch=(kind == "sketch",)))
    policy = Quest(page=case.page, bound=kind, **args)
    sel = policy.select(case.state(), case.q)
    c = case.cache
    if kind == "box":
        bound = reference.quest_page_bound(case.q, c.page_min[0], c.page_max[0], case.scale).double()
    else:
        bound = reference.sketch_page_bound(case.q, c.key_sketch[0], c.page_min[0], c.page_max[0], c.start, c.length, case.scale).double()
    bound = bound.view(case.b, case.h_kv, case.g, -1)
    for r in range(case.b):
        visible = case.visible_pages(r)
        forced = case.forced_pages(r, policy.sinks, policy.window)
        b = bound[r][..., visible]  # [H_kv, G, pages]
        agg = b.amax(1) if policy.aggregate == "max" else torch.softmax(b, -1).sum(1)  # [H_kv, pages]
        for hk in range(case.h_kv):
            score = dict(zip(visible, agg[hk].tolist()))
            kept = set(contract.selected(sel, r, hk))
            free_kept, dropped = kept - forced, set(visible) - kept
            if free_kept and dropped:
                lo = min(score[p] for p in free_kept)
                hi = max(score[p] for p in dropped)
                assert lo >= hi - 2**-7 * abs(hi) - 1e-6, f"kept page bound {lo} < dropped {hi}"


def test_quest_ties_at_bf16_precision_go_to_the_lower_page(make_case):
    """A drawn case where two pages' summed bounds are 0.5% apart (more than 2^-8, less than one bf16
    step): they round to the same score, and the lower page is kept."""
    case = make_case(b=2, h_kv=1, g=3, d=30, page=1, prompt=45, steps=6, starts=[23, 0], seed=1, sharp=0.5)
    policy = Quest(budget=0.875, sinks=0, window=4, aggregate="sum", page=1)
    sel = policy.select(case.state(), case.q)
    c = case.cache
    bound = reference.quest_page_bound(case.q, c.page_min[0], c.page_max[0], case.scale).view(2, 1, 3, -1)
    visible = case.visible_pages(0)
    score = dict(zip(visible, torch.softmax(bound[0][..., visible], -1).sum(1)[0].tolist()))
    kept = set(sel.indices[0, 0, : sel.count[0, 0]].tolist())
    assert 31 in kept and 39 not in kept
    assert 2**-8 < 1 - score[31] / score[39] < 2**-7
    assert torch.tensor(score[31]).bfloat16() == torch.tensor(score[39]).bfloat16()


@SETTINGS
@given(
    data=st.data(),
    sinks=st.integers(0, 8),
    window=st.integers(0, 20),
    aggregate=st.sampled_from(["sum", "max"]),
    full=st.sampled_from(["ratio", "tokens"]),
    bound=st.sampled_from(["box", "sketch"]),
)
def test_full_budget_is_dense(data, cases, contract, sinks, window, aggregate, full, bound):
    case = data.draw(cases(sketch=(bound == "sketch",)))
    budget = 1.0 if full == "ratio" else case.cache.capacity
    policy = Quest(budget=budget, page=case.page, sinks=sinks, window=window, aggregate=aggregate, bound=bound)
    sel = policy.select(case.state(), case.q)
    for r in range(case.b):
        for hk in range(case.h_kv):
            assert sorted(contract.selected(sel, r, hk)) == case.visible_pages(r)
    contract.check_reproduces_dense(sel, case)


def test_quest_hand_made(contract):
    # page 4, left padding 2, 18 tokens: visible 2..17 -> pages 0..4 (page 4 holds 16, 17)
    d = 8
    cache = PagedKVCache(1, 1, 1, d, capacity=20, page_size=4)
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    k = torch.zeros(1, 1, 18, d)
    k[0, 0, :2, 0] = 100.0  # left padding: must not count
    k[0, 0, 9, 0] = 5.0  # page 2 has the best bound
    k[0, 0, 13, 0] = 2.0  # page 3 the second best
    k[0, 0, 4:8, 0] = -3.0  # page 1 the worst (bound -3)
    cache.reset(torch.tensor([2]), 16)
    cache.write_prefill(0, k[:, :, :16], k[:, :, :16])
    for t in (16, 17):
        cache.length += 1
        cache.write(0, k[:, :, t : t + 1], k[:, :, t : t + 1])
    state = KVState(cache, 0, 1.0)

    def pages(**kw):
        sel = Quest(page=4, **kw).select(state, q)
        return sorted(contract.selected(sel, 0, 0))

    # budget 8 tokens = 2 pages; forced: page 0 (sink) and page 4 (window / last page)
    assert pages(budget=8, sinks=1, window=1) == [0, 4]
    assert pages(budget=12, sinks=1, window=1) == [0, 2, 4]
    assert pages(budget=16, sinks=1, window=1) == [0, 2, 3, 4]
    # no sinks, no window: the last page is still kept; ceil(0.6 * 5 visible pages) = 3
    assert pages(budget=0.6, sinks=0, window=0) == [2, 3, 4]
    # a window of 3 tokens (15..17) straddles pages 3 and 4
    assert pages(budget=4, sinks=0, window=3) == [3, 4]
    # the padding keys of page 0 do not raise its bound: with sinks=0 it is dropped before page 3
    assert pages(budget=12, sinks=0, window=1) == [2, 3, 4]


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(budget=0), ValueError, "budget"),
        (dict(budget=1.01), ValueError, "budget"),
        (dict(budget=-0.5), ValueError, "budget"),
        (dict(budget=False), TypeError, "budget"),
        (dict(budget=None), TypeError, "budget"),
        (dict(page=0), ValueError, "page"),
        (dict(page=4.0), TypeError, "page"),
        (dict(sinks=-2), ValueError, "sinks"),
        (dict(window=-1), ValueError, "window"),
        (dict(window=1.5), TypeError, "window"),
        (dict(aggregate="min"), ValueError, "aggregate"),
        (dict(bound="pca"), ValueError, "bound"),
    ],
)
def test_quest_rejects_bad_args(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        Quest(**kwargs)


def test_the_sketch_bound_names_the_summaries_it_reads():
    assert Quest().summaries == ("page_min", "page_max")
    assert Quest(bound="sketch").summaries == ("page_min", "page_max", "key_sketch")


def test_a_sketch_policy_on_a_cache_without_the_sketch_says_so(make_case):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=12, steps=0, starts=[0], seed=0)
    with pytest.raises(RuntimeError, match="keeps no key_sketch"):
        Quest(0.5, page=4, bound="sketch").select(case.state(), case.q)


# ------------------------------------------------------------------------------ two-stage (rescore)
@SETTINGS
@given(data=st.data(), args=quest_args(), factor=st.sampled_from([1, 2, 3.5]))
def test_rescored_quest_keeps_the_best_exact_tokens_of_its_candidate_pages(data, cases, contract, args, factor):
    """Stage one nominates ``factor`` times the pages by bound; stage two keeps, within them, the
    forced tokens and the tokens of highest exact score, as many as the pages would hold."""
    case = data.draw(cases())
    one = Quest(page=case.page, **args)
    two = Quest(page=case.page, rescore=factor, **args)
    state = case.state()
    sel = two.select(state, case.q)
    assert sel.block == 1 and sel.log_weight is None
    contract.check_entries(sel, case, two.sinks, two.window, pages=False)
    contract.check_error_bound(sel, case)
    pages = one.select(state, case.q)
    c = case.cache
    q = case.q.double().view(case.b, case.h_kv, case.g, -1)
    logits = torch.einsum("bkgd,bknd->bkgn", q, c.keys[0].double()) * case.scale  # exact, [B, H_kv, G, N]
    for r in range(case.b):
        for hk in range(case.h_kv):
            kept = set(contract.selected(sel, r, hk))
            n_pages = int(pages.count[r, hk])
            assert len(kept) <= n_pages * case.page  # the same token budget as the one-stage pages
            forced = case.forced_tokens(r, two.sinks, two.window)
            assert forced <= kept
    # Within the candidate tokens, exactly the best exact scores survive (checked on the whole
    # candidate set: a token outside the kept set never outscores a kept, unforced one of its head).
    from policyzoo.kv.choose import candidate_budget, choose_topk
    from policyzoo.kv.scoring import forced_pages, group_page_bounds, page_budget

    k_max, count = page_budget(state, one._budget, case.page, one.sinks, one.window, "Quest")
    wide_k, wide_count = candidate_budget(k_max, count, factor, c.num_pages)
    scores = group_page_bounds(state, case.q) if one.aggregate == "max" else None
    if scores is not None:
        cand = choose_topk(scores, forced_pages(state, one.sinks, one.window), wide_k, wide_count, block=case.page)
        z = logits.amax(2)  # the group's best logit per token
        for r in range(case.b):
            forced = case.forced_tokens(r, two.sinks, max(two.window, 1))
            for hk in range(case.h_kv):
                cand_tokens = {t for p in contract.selected(cand, r, hk) for t in range(p * case.page, (p + 1) * case.page)}
                cand_tokens &= set(case.visible_tokens(r))
                kept = set(contract.selected(sel, r, hk))
                assert kept <= cand_tokens
                free, dropped = kept - forced, cand_tokens - kept
                if free and dropped:
                    lo = min(z[r, hk, t].item() for t in free)
                    hi = max(z[r, hk, t].item() for t in dropped)
                    assert lo >= hi - 1e-2 * (1 + abs(hi)), f"kept token score {lo} < dropped {hi}"


@SETTINGS
@given(data=st.data(), factor=st.sampled_from([1, 3]), full=st.sampled_from(["ratio", "tokens"]))
def test_rescored_quest_at_full_budget_is_dense(data, cases, contract, factor, full):
    case = data.draw(cases())
    budget = 1.0 if full == "ratio" else case.cache.capacity
    sel = Quest(budget=budget, page=case.page, rescore=factor).select(case.state(), case.q)
    contract.check_reproduces_dense(sel, case)


@pytest.mark.parametrize("bad", [0.5, -1, float("inf"), float("nan"), True, "3"])
def test_rescore_must_be_zero_or_a_factor_of_at_least_one(bad):
    from policyzoo.kv import SSA, EntmaxKV

    for cls in (Quest, EntmaxKV, SSA):
        with pytest.raises(ValueError, match="rescore"):
            cls(rescore=bad)
    with pytest.raises(ValueError, match="page proxy"):
        SSA(proxy="exact", rescore=2)


# ----------------------------------------------------------------------- two-level (nominate)
def nominate_args(draw_args: dict) -> dict:
    return {**draw_args, "aggregate": "max", "bound": "sketch"}


@SETTINGS
@given(data=st.data(), args=quest_args(), factor=st.sampled_from([1, 2, 3.5]))
def test_nominated_quest_keeps_the_best_sketch_bounds_among_the_box_candidates(data, cases, contract, args, factor):
    """The box bound nominates ``factor`` times the pages; the kept pages lie within them, keep the
    forced pages, meet the budget, and every kept unforced page's sketch bound is at least that of
    every nominated page left out (up to the ranking's bf16 precision)."""
    from policyzoo.kv.choose import candidate_budget, choose_topk
    from policyzoo.kv.scoring import forced_pages, group_page_bounds, page_budget

    case = data.draw(cases(sketch=(True,)))
    policy = Quest(page=case.page, nominate=factor, **nominate_args(args))
    state = case.state()
    sel = policy.select(state, case.q)
    assert sel.block == case.page and sel.log_weight is None
    contract.check_entries(sel, case, policy.sinks, policy.window, pages=True)
    contract.check_budget(sel, case, policy.budget, policy.sinks, policy.window, pages=True)
    contract.check_error_bound(sel, case)
    k_max, count = page_budget(state, policy._budget, case.page, policy.sinks, policy.window, "Quest")
    wide, wide_count = candidate_budget(k_max, count, factor, case.cache.num_pages)
    box = group_page_bounds(state, case.q, "box")
    cand = choose_topk(box, forced_pages(state, policy.sinks, policy.window), wide, wide_count, block=case.page)
    c = case.cache
    sketch = reference.sketch_page_bound(case.q, c.key_sketch[0], c.page_min[0], c.page_max[0], c.start, c.length,
                                         case.scale, "max").double()
    for r in range(case.b):
        forced = case.forced_pages(r, policy.sinks, policy.window)
        for hk in range(case.h_kv):
            kept, nominated = set(contract.selected(sel, r, hk)), set(contract.selected(cand, r, hk))
            assert forced <= kept <= nominated
            free, dropped = kept - forced, nominated - kept
            if free and dropped:
                lo = min(sketch[r, hk, p].item() for p in free)
                hi = max(sketch[r, hk, p].item() for p in dropped)
                assert lo >= hi - 2**-7 * abs(hi) - 1e-6, f"kept page sketch bound {lo} < nominated, dropped {hi}"


@SETTINGS
@given(data=st.data(), args=quest_args())
def test_nominating_every_page_is_the_sketch_bound(data, cases, args):
    """With a factor that nominates every visible page, the two levels choose what the sketch alone
    chooses, page for page."""
    case = data.draw(cases(sketch=(True,)))
    state = case.state()
    alone = Quest(page=case.page, **nominate_args(args)).select(state, case.q)
    every = Quest(page=case.page, nominate=float(case.cache.num_pages), **nominate_args(args)).select(state, case.q)
    assert torch.equal(alone.count, every.count)
    assert torch.equal(alone.entry_valid(), every.entry_valid())
    ok = alone.entry_valid()
    assert torch.equal(alone.indices[ok], every.indices[ok])


@SETTINGS
@given(data=st.data(), factor=st.sampled_from([1, 3]), full=st.sampled_from(["ratio", "tokens"]), rescore=st.sampled_from([0, 2]))
def test_nominated_quest_at_full_budget_is_dense(data, cases, contract, factor, full, rescore):
    case = data.draw(cases(sketch=(True,)))
    budget = 1.0 if full == "ratio" else case.cache.capacity
    policy = Quest(budget=budget, page=case.page, bound="sketch", nominate=factor, rescore=rescore)
    contract.check_reproduces_dense(policy.select(case.state(), case.q), case)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nominate=2), "bound='sketch'"),
        (dict(nominate=2, bound="sketch", aggregate="sum"), "aggregate='max'"),
        (dict(nominate=0.5, bound="sketch"), "nominate must be 0"),
        (dict(nominate=True, bound="sketch"), "nominate must be 0"),
    ],
)
def test_nominate_needs_the_sketch_and_a_factor(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Quest(**kwargs)
