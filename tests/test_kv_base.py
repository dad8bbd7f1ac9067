"""Contract tests of the shared KV-policy machinery (`policyzoo.kv.base`) and of `Dense`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo import kernels
from policyzoo.kernels import reference
from policyzoo.kv import SSA, Certified, Dense, KVSelector, PrHS, Quest
from policyzoo.kv.base import (
    Budget,
    aggregate_groups,
    candidate_budget,
    check_budget,
    check_count,
    choose_topk,
    choose_topk_steps,
    exact_scores,
    forced_at,
    forced_pages,
    forced_tokens,
    group_page_bounds,
    page_bound_scores,
    round_for_ranking,
)

SETTINGS = settings(max_examples=50, deadline=None)
INF = math.inf


def _sel_sets(sel):
    return [[set(sel.indices[b, h, : int(sel.count[b, h])].tolist()) for h in range(sel.count.shape[1])] for b in range(sel.count.shape[0])]


# ------------------------------------------------------------------------------------ budgets
def test_budget_kinds():
    assert Budget(0.5).is_ratio and not Budget(3).is_ratio
    assert not Budget(1).is_ratio and Budget(1.0).is_ratio  # 1 token vs the whole context
    assert Budget(0.5).k_max(10) == 5 and Budget(0.01).k_max(10) == 1 and Budget(1.0).k_max(7) == 7
    assert Budget(3).k_max(10) == 3 and Budget(30).k_max(10) == 10
    n = torch.tensor([0, 1, 7, 10])
    assert Budget(0.5).count(n).tolist() == [0, 1, 4, 5]
    assert Budget(3).count(n).tolist() == [3, 3, 3, 3]
    assert Budget(0.5).count(n).dtype == torch.long
    assert Budget(0.07).count(torch.tensor([100])).tolist() == [7]  # 0.07 * 100 = 7.000000000000001 in floats


@SETTINGS
@given(ratio=st.floats(1e-6, 1.0), capacity=st.integers(1, 5000), data=st.data())
def test_ratio_budget_count_and_width(ratio, capacity, data):
    n = data.draw(st.lists(st.integers(0, capacity), min_size=1, max_size=4))
    b = Budget(ratio)
    counts = b.count(torch.tensor(n))
    assert counts.tolist() == [math.ceil(ratio * x - 1e-9) for x in n]
    assert 1 <= b.k_max(capacity) <= capacity
    assert bool((counts <= b.k_max(capacity)).all())  # the static width always holds the count


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0000001, 2.0, float("nan"), float("inf"), -float("inf")])
def test_ratio_outside_unit_interval(bad):
    with pytest.raises(ValueError, match="budget"):
        Budget(bad)
    with pytest.raises(ValueError, match="my_keep"):
        check_budget(bad, "my_keep")


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_non_positive_token_budget(bad):
    with pytest.raises(ValueError, match="budget"):
        Budget(bad)
    with pytest.raises(ValueError, match="tokens_arg"):
        check_budget(bad, "tokens_arg")


@pytest.mark.parametrize("bad", [True, False, "0.5", "8", None, [4], torch.tensor(4)])
def test_budget_wrong_type(bad):
    with pytest.raises(TypeError, match="budget"):
        Budget(bad)
    with pytest.raises(TypeError, match="xyz"):
        check_budget(bad, "xyz")


def test_check_count():
    check_count(0, "sinks")
    check_count(3, "window", minimum=1)
    with pytest.raises(ValueError, match="window"):
        check_count(0, "window", minimum=1)
    with pytest.raises(ValueError, match="sinks"):
        check_count(-1, "sinks")
    for bad in (1.0, True, "2", None):
        with pytest.raises(TypeError, match="sinks"):
            check_count(bad, "sinks")


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


def test_two_stage_sees_through_wrappers():
    assert Quest(0.1, rescore=2).two_stage and Certified(Quest(0.1, rescore=2)).two_stage
    assert PrHS(SSA(0.1, 0.1, rescore=2), time=0.9).two_stage
    assert not Quest(0.1).two_stage and not Dense().two_stage and not Certified(Quest(0.1)).two_stage


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


def test_selector_base_is_abstract():
    with pytest.raises(NotImplementedError):
        KVSelector().select(None, torch.zeros(1, 1, 8))


# ------------------------------------------------------------------------------------- Dense
@SETTINGS
@given(data=st.data())
def test_dense_selects_every_visible_page(data, cases, contract):
    case = data.draw(cases())
    sel = Dense().select(case.state(), case.q)
    assert sel.block == case.page and sel.log_weight is None
    contract.check_entries(sel, case, 0, 0, pages=True)
    for r in range(case.b):
        for hk in range(case.h_kv):
            assert sorted(contract.selected(sel, r, hk)) == case.visible_pages(r)
    contract.check_error_bound(sel, case)  # delta = 0: exact
    tv = case.cache.token_valid()
    p = reference.dense_probs(case.q, case.cache.keys[0], case.cache.start, case.cache.length, case.scale)
    from policyzoo.eval.metrics import dropped_mass

    torch.testing.assert_close(dropped_mass(p, sel, tv), torch.zeros(case.b, case.h), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- learned parameters
def test_a_policy_without_modules_has_no_learned_parameters(tmp_path):
    from policyzoo import Quest

    q = Quest(0.25)
    assert q.modules() == {} and list(q.parameters()) == [] and q.state_dict() == {}
    assert q.to(dtype=torch.float64) is q
    with pytest.raises(ValueError, match="no learned parameters"):
        q.save(tmp_path / "q.safetensors")


def test_learned_parts_save_and_load_with_their_parameters(tmp_path):
    from tiny_models import LearnedQuest

    policy = LearnedQuest(0.3, page=4, hidden_size=64, kv_heads=2)
    assert set(policy.modules()) == {"head"} and set(policy.state_dict()) == {"head.weight", "head.bias"}
    path = policy.save(tmp_path / "learned.safetensors")
    back = LearnedQuest.load(path)
    assert back == policy  # the dataclass parameters
    for key, value in policy.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)
    assert LearnedQuest.load(path, budget=0.5).budget == 0.5  # overrides replace saved parameters
    with pytest.raises(ValueError, match="do not fit"):
        LearnedQuest.load(path, hidden_size=32)  # the head's shape follows the parameters
    with pytest.raises(ValueError, match="holds a LearnedQuest policy, not Quest"):
        from policyzoo import Quest

        Quest.load(path)
    with pytest.raises(FileNotFoundError, match="no policy file"):
        LearnedQuest.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="no learned part 'tail'"):
        policy.load_state_dict({"tail.weight": torch.zeros(1)})


def test_the_decoder_moves_learned_parameters_to_the_model_and_loaded_weights_decode_alike(tmp_path):
    from tiny_models import LearnedQuest, padded_batch, tiny_model

    from policyzoo import Decoder

    model = tiny_model("llama").to(torch.bfloat16)
    policy = LearnedQuest(0.25, page=4, sinks=1, window=4, hidden_size=64, kv_heads=2)
    torch.nn.init.normal_(policy.head.weight, std=2.0)
    dec = Decoder(model, kv=policy)
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    ids, mask = padded_batch(2, 64)
    out = dec.generate(ids, 6, attention_mask=mask)
    loaded = LearnedQuest.load(policy.save(tmp_path / "p.safetensors"))
    assert torch.equal(Decoder(model, kv=loaded).generate(ids, 6, attention_mask=mask), out)
    torch.nn.init.zeros_(loaded.head.weight)  # other weights: another selection, other tokens
    torch.nn.init.zeros_(loaded.head.bias)
    plain = Decoder(model, kv=loaded).generate(ids, 6, attention_mask=mask)
    assert not torch.equal(plain, out)


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
