"""Contract of `policyzoo.kv.CommunityKV` (issue 20): its communities cover every visible token once,
its selection holds the forced tokens and the best-scored communities within the budget, appends keep
every centroid the mean of its community's keys, a needle's part of a split community is kept where
the whole community's mean drops it, a
full budget decodes as dense, it decodes compiled with one graph, and a missing extra says how to
install it."""

from __future__ import annotations

import copy
import functools
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import padded_batch, tiny_model

from policyzoo import Certified, Decoder, PrHS
from policyzoo.kv import CommunityKV
from policyzoo.spec import parse_kv

SETTINGS = settings(max_examples=30, deadline=None)
SMALL = dict(sinks=2, window=2)


@st.composite
def community_args(draw):
    if draw(st.booleans()):
        budget = draw(st.integers(1, 60))
    else:
        budget = draw(st.floats(1e-3, 1.0))
    return dict(
        budget=budget, sinks=draw(st.integers(0, 6)), window=draw(st.integers(1, 12)), top=draw(st.integers(1, 8)),
        mix=draw(st.sampled_from([0.0, 0.5, 1.0])), graph=draw(st.sampled_from(["group", "head"])),
        resolution=draw(st.sampled_from([10.0, 100.0, 1000.0])), split=draw(st.sampled_from([0, 1, 2, 4, 8])),
    )  # fmt: skip


def prefilled(case, policy, seed=0):
    """``policy`` prefilled on ``case``'s one-layer cache, from random queries at every slot."""
    state = case.state()
    q = torch.randn(case.b, case.h, case.length, case.d, generator=torch.Generator().manual_seed(seed))
    policy.prefill(state, q * 2, None, None)
    return state


def append_tokens(case, policy, state, n, seed=1):
    """Write ``n`` decode tokens into ``case``'s cache as the Decoder does, telling the policy."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        case.cache.length += 1
        k = torch.randn(case.b, case.h_kv, 1, case.d, generator=gen)
        case.cache.write(0, k, torch.randn(case.b, case.h_kv, 1, case.d, generator=gen))
        policy.append(state, k, None)


def units(case, policy):
    return case.h_kv if policy.graph == "group" else case.h


def community_scores(case, policy, state):
    """Per (row, KV head): ``[(members, score)]`` of its candidate communities, each score recomputed
    from the members' keys (``scale · q · mean``, the group's best query head in group mode)."""
    keys = case.cache.keys[0].double()
    q = case.q.double()
    g = case.g
    out = {}
    for r in range(case.b):
        for hk in range(case.h_kv):
            found = []
            for u in ([hk] if policy.graph == "group" else range(hk * g, (hk + 1) * g)):
                heads = range(hk * g, (hk + 1) * g) if policy.graph == "group" else [u]
                for members in policy.members(state, r, u):
                    mean = keys[r, hk, members].mean(0)
                    found.append((members, max(case.scale * float(q[r, x] @ mean) for x in heads)))
            out[r, hk] = found
    return out


@SETTINGS
@given(data=st.data(), args=community_args(), leiden=st.sampled_from(["igraph", "leidenalg"]), appends=st.integers(0, 4))
def test_communities_cover_every_visible_token_exactly_once(data, cases, args, leiden, appends):
    case = data.draw(cases(min_extra=4))
    policy = CommunityKV(leiden=leiden, **args)
    state = prefilled(case, policy)
    append_tokens(case, policy, state, appends)
    for r in range(case.b):
        for u in range(units(case, policy)):
            members = policy.members(state, r, u)
            assert all(members), "no empty community"
            flat = [t for c in members for t in c]
            assert sorted(flat) == case.visible_tokens(r), f"row {r} unit {u}"


@SETTINGS
@given(data=st.data(), args=community_args(), appends=st.integers(0, 4))
def test_the_policy_contract_on_filled_caches(data, cases, contract, args, appends):
    case = data.draw(cases(min_extra=4))
    policy = CommunityKV(**args)
    state = prefilled(case, policy)
    for step in range(appends + 1):
        if step:
            append_tokens(case, policy, state, 1, seed=step)
        sel = policy.select(state, case.q)
        assert sel.block == 1 and sel.log_weight is None
        contract.check_entries(sel, case, policy.sinks, policy.window, pages=False)
        contract.check_budget(sel, case, policy.budget, policy.sinks, policy.window, pages=False)
        contract.check_error_bound(sel, case)
        for r in range(case.b):
            for hk in range(case.h_kv):
                kept = contract.selected(sel, r, hk)
                assert len(kept) == len(set(kept)), "each token once"


@SETTINGS
@given(data=st.data(), args=community_args(), appends=st.integers(0, 3))
def test_the_selection_holds_the_best_scored_communities(data, cases, contract, args, appends):
    """Whole communities in score order fill the budget, the last one cut: every kept unforced token
    lies in a community scoring at least the second best of those with a token left out (the best of
    them may be the cut one), up to the ranking's bf16 precision."""
    case = data.draw(cases(min_extra=4))
    policy = CommunityKV(**args)
    state = prefilled(case, policy)
    append_tokens(case, policy, state, appends)
    sel = policy.select(state, case.q)
    scores = community_scores(case, policy, state)
    for r in range(case.b):
        forced = case.forced_tokens(r, policy.sinks, policy.window)
        for hk in range(case.h_kv):
            kept = set(contract.selected(sel, r, hk))
            left = sorted((s for members, s in scores[r, hk] if any(t not in kept and t not in forced for t in members)), reverse=True)
            if len(left) < 2:
                continue
            bar = left[1] - 2**-7 * abs(left[1]) - 1e-5
            for t in kept - forced:
                best = max(s for members, s in scores[r, hk] if t in members)
                assert best >= bar, f"row {r} head {hk}: token {t} kept through a community of score {best} < {left[1]}"


@pytest.mark.parametrize("graph", ["group", "head"])
def test_a_part_of_keys_that_match_the_query_is_kept_where_its_communitys_mean_drops_it(make_case, graph):
    """A community of four keys along the query and four against it has a negative mean logit: whole,
    it ranks below communities of small positive logits. Split into parts of 4 along its keys, the
    matching four are a part of their own, which ranks first: with room for four tokens besides the
    sinks and the window, ``split=4`` keeps them and ``split=0`` keeps none of them."""
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=40, steps=0, starts=[0], seed=0)
    keys = case.cache.keys[0]
    keys.zero_()
    keys[0, 0, :, 0] = 0.1  # every community: a small positive logit
    needles, others = [16, 18, 20, 22], [17, 19, 21, 23]  # one community of runs_of(size=8)
    keys[0, 0, needles, 0], keys[0, 0, others, 0] = 2.0, -3.0
    case.q.zero_()
    case.q[0, :, 0] = 2.0
    kept = {}
    for split in (4, 0):
        policy = CommunityKV(8, split=split, graph=graph, partition=functools.partial(runs_of, size=8), **SMALL)
        state = prefilled(case, policy)
        sel = policy.select(state, case.q)
        kept[split] = set(sel.indices[0, 0, : int(sel.count[0, 0])].tolist())
        assert len(kept[split]) == 8  # the sinks, the window and four community tokens
        assert max(map(len, policy.members(state, 0, 0))) == (4 if split else 8)
    assert set(needles) <= kept[4]
    assert not set(needles) & kept[0]


@pytest.mark.parametrize("graph", ["group", "head"])
def test_appends_keep_every_centroid_the_mean_of_its_keys(graph):
    model = tiny_model("qwen3", layers=2)
    ids, mask = padded_batch(3, 30)
    policy = CommunityKV(0.4, graph=graph, **SMALL)
    dec = Decoder(model, kv=policy)
    dec.generate(ids, 12, attention_mask=mask)
    cache = dec.session.cache
    for layer, state in enumerate(b.state for b in dec.session.backends):
        centroid, size = state.layer_state_of(policy).centroid, state.layer_state_of(policy).size
        per_kv = centroid.shape[1] // cache.num_kv_heads
        for r in range(cache.batch):
            visible = list(range(int(cache.start[r]), int(cache.length)))
            for u in range(centroid.shape[1]):
                members = policy.members(state, r, u)
                assert sorted(t for c in members for t in c) == visible  # the 11 appended tokens included
                want = torch.stack([cache.keys[layer][r, u // per_kv, c].double().mean(0) for c in members])
                torch.testing.assert_close(centroid[r, u, : len(members)].double(), want, rtol=1e-5, atol=1e-5)
                assert size[r, u, : len(members)].tolist() == [len(c) for c in members]
        assert torch.equal(state.layer_state_of(policy).centroid_key, centroid.to(cache.dtype))  # what decode scores
    assert policy.clustering.tokens == sum(30 - 3 * i for i in range(3))
    assert policy.clustering.graphs == 2 * 3 * centroid.shape[1] and policy.clustering.leiden_seconds > 0


@pytest.mark.parametrize("graph", ["group", "head"])
def test_a_new_token_joins_the_nearest_candidate_with_room(make_case, graph):
    """The local rule: one of the last query's best communities (`recent`), the nearest by key among
    those with room; the roomiest community when none has room."""
    case = make_case(b=1, h_kv=2, g=2, d=8, page=4, prompt=40, steps=0, starts=[0], seed=0, extra=4)
    policy = CommunityKV(0.5, graph=graph, candidates=2, **SMALL)
    state = prefilled(case, policy)
    store = state.layer_state_of(policy)
    for full in (False, True):
        policy.select(state, case.q)  # ranks the communities: `recent` becomes this query's best
        units = store.size.shape[1]
        recent = store.recent.clone()
        size, room = store.size.clone(), store.room
        if full:  # no candidate has room left
            store.size.scatter_(2, recent, torch.gather(room, 2, recent))
            size = store.size.clone()
            assert ((room - size) > 0).any(-1).all()  # but some other community has
            # The step's selection after the sizes changed, as in decoding: it finds the roomiest
            # (the scores, and so the candidates, are as they were).
            policy.select(state, case.q)
            assert torch.equal(store.recent, recent)
        case.cache.length += 1
        k = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(int(full)))
        case.cache.write(0, k, torch.zeros_like(k))
        centroid = store.centroid.clone()
        policy.append(state, k, None)
        for u in range(units):
            joined = int((store.size[0, u] - size[0, u]).argmax())
            assert int((store.size[0, u] - size[0, u]).sum()) == 1
            if full:
                assert joined == int((room[0, u] - size[0, u]).argmax())
            else:
                key = k[0, u // (units // 2), 0]
                dist = {int(c): float((centroid[0, u, c] - key).square().sum()) for c in recent[0, u]}
                assert joined == min(dist, key=dist.get)


@pytest.mark.parametrize("graph", ["group", "head"])
def test_full_budget_decodes_as_dense(graph):
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 50)
    dense = Decoder(model).generate(ids, 8, attention_mask=mask)
    full = Decoder(model, kv=CommunityKV(1.0, graph=graph, **SMALL)).generate(ids, 8, attention_mask=mask)
    assert torch.equal(full, dense)


def test_compiled_steps_replay_one_graph_and_match_eager():
    from torch._dynamo.utils import counters

    model = tiny_model("llama", layers=1)
    ids, mask = padded_batch(2, 45)
    eager = Decoder(copy.deepcopy(model), kv=CommunityKV(0.3, **SMALL)).generate(ids, 30, attention_mask=mask)
    dense = Decoder(copy.deepcopy(model)).generate(ids, 30, attention_mask=mask)
    assert not torch.equal(eager, dense)  # the selection matters: the test has power
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=CommunityKV(0.3, **SMALL), compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = dec.generate(ids, 30, attention_mask=mask)
        second = dec.generate(ids, 30, attention_mask=mask)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0


def test_worker_processes_make_the_communities_this_process_makes():
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 40)
    inline, pooled = CommunityKV(0.3, workers=1, **SMALL), CommunityKV(0.3, workers=2, **SMALL)
    runs, sessions = [], []
    for policy in (inline, pooled):
        dec = Decoder(copy.deepcopy(model), kv=policy)
        sessions.append(dec.session)
        runs.append((dec.generate(ids, 10, attention_mask=mask), [vars(b.state.layer_state_of(policy)) for b in dec.session.backends]))
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        for name in ("order", "offset", "size", "room", "centroid"):
            assert torch.equal(a[name], b[name]), name
    assert sessions[1].workers.size == 2 and sessions[0].workers.size == 0  # the session's pool ran the graphs
    assert pooled.clustering.graphs == inline.clustering.graphs == 2 * 2 * model.config.num_key_value_heads
    assert copy.deepcopy(pooled) == pooled  # the policy holds no processes
    sessions[1].retire()
    assert sessions[1].workers.size == 0


@pytest.mark.parametrize("wrap", [lambda p: PrHS(p, time=0.9), lambda p: Certified(p, eps=0.1)], ids=["prhs-time", "certified"])
def test_wrapping_policies_finish_its_prefill(wrap):
    """`finish_prefill` reaches the policy through PrHS (whose time reuse selects right after each
    layer's prefill) and Certified: every layer is laid out, nothing is left pending."""
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 40)
    dec = Decoder(model, kv=wrap(CommunityKV(0.3, **SMALL)))
    dec.session.prefill(ids, mask, capacity=50)  # no step yet: only finish_prefill lays them out
    for state in (b.state for b in dec.session.backends):
        layer = state.layer_state_of(dec.kv.policy)
        assert layer.laid_out and layer.jobs is None


def runs_of(n, lo, hi, weight, gamma, seed, size):
    """A partition function: runs of ``size`` consecutive tokens, whatever the graph."""
    assert lo.dtype == hi.dtype == torch.long and weight.dtype == torch.float64 and bool((lo < hi).all())
    return torch.arange(n) // size


def test_a_partition_function_replaces_leiden(make_case, monkeypatch):
    """``partition`` gets each graph as edge tensors and its answer is the layout's communities
    (Leiden is not even imported: the extra is not needed)."""
    monkeypatch.setitem(sys.modules, "igraph", None)
    case = make_case(b=2, h_kv=2, g=2, d=8, page=4, prompt=30, steps=0, starts=[0, 5], seed=0)
    policy = CommunityKV(0.5, partition=functools.partial(runs_of, size=4), **SMALL)
    state = prefilled(case, policy)
    for row, start in enumerate([0, 5]):
        for unit in range(case.h_kv):
            members = policy.members(state, row, unit)
            assert sorted(map(sorted, members)) == [list(range(s, min(s + 4, 30))) for s in range(start, 30, 4)]
    assert policy.clustering.graphs == 2 * case.h_kv


@pytest.mark.parametrize("answer", [lambda n: torch.zeros(n + 1, dtype=torch.long), lambda n: torch.zeros(n),
                                    lambda n: torch.full((n,), -1)], ids=["length", "float", "negative"])
def test_a_partition_function_that_answers_wrong_is_refused(make_case, answer):
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=12, steps=0, starts=[0], seed=0)
    with pytest.raises(ValueError, match="partition function"):
        policy = CommunityKV(0.5, partition=lambda n, *_: answer(n))
        prefilled(case, policy)
        policy.finish_prefill([])


@pytest.mark.parametrize("leiden, missing", [("igraph", "igraph"), ("leidenalg", "leidenalg"), ("leidenalg", "igraph")])
def test_a_missing_extra_says_how_to_install_it(make_case, monkeypatch, leiden, missing):
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=12, steps=0, starts=[0], seed=0)
    monkeypatch.setitem(sys.modules, missing, None)  # `import` of a None entry raises ImportError
    with pytest.raises(ImportError, match=r'pip install "policyzoo\[community\]"'):
        prefilled(case, CommunityKV(0.5, leiden=leiden))


def test_select_before_a_prefill_says_what_it_needs(make_case):
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=12, steps=0, starts=[0], seed=0)
    for call in (lambda p, s: p.select(s, case.q), lambda p, s: p.append(s, case.real_k[:, :, :1], None)):
        with pytest.raises(RuntimeError, match="prefill"):
            call(CommunityKV(0.5), case.state())


def test_the_spec_builds_it():
    policy = parse_kv("community-kv:0.1,graph=head,resolution=30.0,leiden=leidenalg")
    assert policy == CommunityKV(0.1, graph="head", resolution=30.0, leiden="leidenalg")
    assert parse_kv("community-kv:0.1") == CommunityKV(0.1)
    assert parse_kv("community-kv:0.1,split=0") == CommunityKV(0.1, split=0) != CommunityKV(0.1)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(budget=0), ValueError, "budget"),
        (dict(budget=1.5), ValueError, "budget"),
        (dict(top=0), ValueError, "top"),
        (dict(mix=1.5), ValueError, "mix"),
        (dict(mix="x"), ValueError, "mix"),
        (dict(graph="layer"), ValueError, "graph"),
        (dict(split=-1), ValueError, "split"),
        (dict(split=2.0), TypeError, "split"),
        (dict(resolution=0.0), ValueError, "resolution"),
        (dict(resolution=math.inf), ValueError, "resolution"),
        (dict(leiden="louvain"), ValueError, "leiden"),
        (dict(sinks=-1), ValueError, "sinks"),
        (dict(window=0), ValueError, "window"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(workers=0), ValueError, "workers"),
        (dict(candidates=0), ValueError, "candidates"),
        (dict(partition="runs"), TypeError, "partition"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        CommunityKV(**kwargs)


def test_more_graph_keys_than_the_prompt_has_are_capped_at_the_prompt(make_case):
    """``top`` past the tokens a query sees is every pair already: the graph is built, not the
    memory of ``top`` entries per query."""
    case = make_case(b=1, h_kv=2, g=2, d=8, page=4, prompt=24, steps=0, starts=[0], seed=1)
    policies = CommunityKV(0.5, top=10_000, **SMALL), CommunityKV(0.5, top=24, **SMALL)
    many, every = (prefilled(case, p) for p in policies)
    for policy, state in zip(policies, (many, every)):
        policy.finish_prefill([state])
    for name in ("order", "size"):
        assert torch.equal(getattr(many.layer_state_of(policies[0]), name), getattr(every.layer_state_of(policies[1]), name)), name


def test_a_partition_function_that_returns_nothing_is_named():
    from policyzoo.kv.community_graph import _checked

    with pytest.raises(TypeError, match="partition function must return n=5 integer community ids .* got NoneType"):
        _checked(None, 5)
