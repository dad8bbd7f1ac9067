"""Tests of `policyzoo.kv.SSA` (stratified sparse attention: top stratum + Horvitz–Thompson samples).

The statistical tests draw many independent selections in one call: a case row is replicated into
a cache of ``R`` identical rows, and each row gets its own draws from a `torch.Generator`
(`own_draws`: the default hash generator gives every row of a batch the same draws, by design, so
that a row decodes the same in any batch). They run with ``derandomize=True`` and fixed policy
seeds, so a failure reproduces exactly; `test_hash_generator_estimates_are_unbiased` checks the
default generator with one draw per call.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.cache import PagedKVCache
from policyzoo.kernels import reference
from policyzoo.selection import Selection
from policyzoo.kv import SSA, AttentionTopK, Dense, KVState, Quest
from policyzoo.kv.ssa import hash_uniform

SETTINGS = settings(max_examples=30, deadline=None)
STAT_SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None)
Z_SCORE = 5.0  # standard errors allowed in the statistical tests


@st.composite
def ssa_args(draw, schemes=("with_replacement", "gumbel_topk"), temperatures=(0.5, 1.0, 2.0), min_sample=0):
    def amount(lo):
        if draw(st.booleans()):
            return draw(st.integers(lo, 40))
        return draw(st.floats(1e-3, 1.0))

    proxy = draw(st.sampled_from(["page", "exact"]))
    return dict(
        budget=amount(0),
        sample=amount(min_sample),
        proxy=proxy,
        rescore=draw(st.sampled_from([0, 0, 2])) if proxy == "page" else 0,
        temperature=draw(st.sampled_from(temperatures)),
        sinks=draw(st.integers(0, 6)),
        window=draw(st.integers(0, 12)),
        aggregate=draw(st.sampled_from(["sum", "max"])),
        scheme=draw(st.sampled_from(schemes)),
        seed=draw(st.integers(0, 2**16)),
    )


def _entries(value, unit: int, n_valid: int) -> int:
    """Entries a budget or sample amount means for a row with ``n_valid`` visible entries."""
    if isinstance(value, int):
        return -(-value // unit)
    return math.ceil(value * n_valid - 1e-9)


def replicate(case, row: int, reps: int) -> tuple[KVState, torch.Tensor]:
    """A cache of ``reps`` copies of one row of ``case`` (same keys, values, summaries, padding)."""
    c = case.cache
    rc = PagedKVCache(1, reps, c.num_kv_heads, c.head_dim, c.capacity, page_size=c.page_size, dtype=c.dtype)
    for name in ("keys", "values", "page_min", "page_max", "page_mean", "page_std"):
        src = getattr(c, name)[0][row : row + 1]
        getattr(rc, name)[0].copy_(src.expand(reps, *src.shape[1:]))
    rc.start.fill_(int(c.start[row]))
    rc.length.copy_(c.length)
    return KVState(rc, 0, case.scale), case.q[row : row + 1].expand(reps, -1, -1).contiguous()


def own_draws(policy: SSA) -> SSA:
    """``policy`` drawing from a seeded `torch.Generator`, in order: each row of a replicated cache
    then gets its own draws."""
    return dataclasses.replace(policy, generator=torch.Generator().manual_seed(policy.seed))


def attend_state(state: KVState, q, sel):
    c = state.cache
    return reference.decode_attention(q, c.keys[0], c.values[0], sel, c.start, c.length, state.scale)


# ------------------------------------------------------------------------------------- contract
@SETTINGS
@given(data=st.data(), args=ssa_args())
def test_ssa_contract(data, cases, contract, args):
    case = data.draw(cases())
    policy = SSA(page=case.page, **args)
    pages = policy.proxy == "page"
    assert policy.page_size == (case.page if pages else None)
    state = case.state()
    sel = policy.select(state, case.q)
    assert sel.block == (case.page if pages else 1)
    contract.check_entries(sel, case, policy.sinks, policy.window, pages=pages)

    det = SSA(**{**args, "sample": 0}, page=case.page).select(state, case.q)
    assert det.log_weight is None
    if policy.sample == 0:
        assert sel.log_weight is None and torch.equal(sel.indices, det.indices)
        return
    unit = case.page if pages else 1
    for r in range(case.b):
        n_valid = len(case.visible_pages(r)) if pages else case.n_valid(r)
        m = min(_entries(policy.sample, unit, n_valid), case.cache.num_pages if pages else case.cache.capacity)
        for hk in range(case.h_kv):
            got = contract.selected(sel, r, hk)
            first = contract.selected(det, r, hk)
            # The deterministic stratum comes first, with weight 0: sample=0's choice, unchanged.
            # With rescore both strata rank on the log-mass of candidates widened by the sample too
            # (`SSA.rescore`), so the stratum is a choice of the same size that may differ from it.
            if policy.rescore:
                assert len(set(got[: len(first)])) == len(first)
            else:
                assert got[: len(first)] == first
            c, cd = int(sel.count[r, hk]), len(first)
            assert cd <= c <= cd + m
            lw = sel.log_weight[r, hk]
            assert bool((lw[:cd] == 0).all())
            # ... then the unique sampled entries, weight -log π >= 0; padding has weight 0.
            assert bool(torch.isfinite(lw[cd:c]).all()) and bool((lw[cd:c] >= -1e-6).all())
            assert bool((lw[c:] == 0).all())
    assert sel.log_weight.dtype == torch.float32
    o, lse = contract.attend(case, sel)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all())


@SETTINGS
@given(
    data=st.data(),
    budget=st.one_of(st.integers(1, 40), st.floats(1e-3, 1.0)),
    sinks=st.integers(0, 6),
    window=st.integers(0, 12),
    aggregate=st.sampled_from(["sum", "max"]),
)
def test_sample_zero_is_topk(data, cases, budget, sinks, window, aggregate):
    """``sample=0`` is exactly Quest (page proxy) and AttentionTopK (exact proxy)."""
    case = data.draw(cases())
    state = case.state()
    kw = dict(budget=budget, sinks=sinks, window=window, aggregate=aggregate)
    ssa = SSA(sample=0, proxy="page", page=case.page, **kw).select(state, case.q)
    quest = Quest(page=case.page, **kw).select(state, case.q)
    assert torch.equal(ssa.indices, quest.indices) and torch.equal(ssa.count, quest.count)
    assert ssa.block == quest.block and ssa.log_weight is None
    if isinstance(budget, int):
        kw["budget"] = max(budget, sinks + window)  # AttentionTopK's budget must cover them
    ssa = SSA(sample=0, proxy="exact", **kw).select(state, case.q)
    topk = AttentionTopK(**kw).select(state, case.q)
    assert torch.equal(ssa.indices, topk.indices) and torch.equal(ssa.count, topk.count)
    assert ssa.log_weight is None


@SETTINGS
@given(data=st.data(), args=ssa_args())
def test_budget_zero_keeps_only_forced_deterministically(data, cases, contract, args):
    case = data.draw(cases())
    args = {**args, "budget": 0, "sample": args["sample"] or 1}
    sel = SSA(page=case.page, **args).select(case.state(), case.q)
    pages = args["proxy"] == "page"
    for r in range(case.b):
        forced = (case.forced_pages if pages else case.forced_tokens)(r, args["sinks"], args["window"])
        for hk in range(case.h_kv):
            got = contract.selected(sel, r, hk)
            lw = sel.log_weight[r, hk, : len(got)]
            assert {g for g, w in zip(got, lw.tolist()) if w == 0.0} >= forced
            assert set(got[: len(forced)]) == forced


@SETTINGS
@given(data=st.data(), args=ssa_args())
def test_reproducible_from_the_seed(data, cases, args):
    case = data.draw(cases(max_prompt=24))
    state = case.state()
    a, b = SSA(page=case.page, **args), SSA(page=case.page, **args)
    s1, s2 = a.select(state, case.q), b.select(state, case.q)
    same = lambda x, y: torch.equal(x.indices, y.indices) and torch.equal(x.count, y.count) and (  # noqa: E731
        x.log_weight is y.log_weight is None or torch.equal(x.log_weight, y.log_weight)
    )
    assert same(s1, s2)
    a.select(state, case.q)  # the stream moves on ...
    a.reseed(args["seed"])  # ... and restarts
    assert same(s1, a.select(state, case.q))


def test_explicit_generator_is_reproducible(make_case):
    case = make_case(b=2, h_kv=2, g=2, d=8, page=4, prompt=40, steps=1, starts=[0, 3], seed=8)
    picks = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(123)
        sel = SSA(budget=8, sample=16, page=4, generator=gen).select(case.state(), case.q)
        picks.append((sel.indices, sel.log_weight))
    assert torch.equal(picks[0][0], picks[1][0]) and torch.equal(picks[0][1], picks[1][1])


def test_hash_uniforms_look_uniform():
    """Moments, range and independence of neighbouring draws and counters of `hash_uniform`."""
    state = torch.tensor([7, 0, 0])
    u = hash_uniform(state, torch.arange(200_000))
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.var()) - 1 / 12) < 0.002
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    state[2] += 1
    v = hash_uniform(state, torch.arange(200_000))
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.01
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert float(((counts - 10_000) ** 2 / 10_000).sum()) < 60  # chi-square, 19 dof


def test_select_traces_without_graph_breaks(make_case):
    """The default (hash) generator keeps `select` in one graph under torch.compile."""
    case = make_case(b=2, h_kv=2, g=2, d=8, page=4, prompt=40, steps=1, starts=[0, 3], seed=8)
    state = case.state()
    for scheme in ("with_replacement", "gumbel_topk"):
        policy = SSA(budget=8, sample=16, page=4, scheme=scheme)
        policy.prefill(state, case.q, None, None)

        def step(q):
            sel = policy.select(state, q)
            return sel.indices, sel.count, sel.log_weight

        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(case.q)
        assert explained.graph_break_count == 0, explained.break_reasons


# ---------------------------------------------------------------------------------- statistics
def check_unbiased(case, row: int, policy: SSA, reps: int) -> None:
    """Mean over ``reps`` draws of ``Ẑ = Σ w e^z`` and ``N̂ = Σ w e^z v`` is the dense ``Z`` and ``N``
    (both relative to the dense ``Z``), within `Z_SCORE` standard errors."""
    state, q = replicate(case, row, reps)
    sel = own_draws(policy).select(state, q)
    o_hat, lse_hat = attend_state(state, q, sel)
    o, lse = attend_state(case.state(), case.q, Dense().select(case.state(), case.q))
    o, lse = o[row : row + 1], lse[row : row + 1]
    z_hat = torch.exp(lse_hat.double() - lse.double())
    est = torch.cat([z_hat[..., None], o_hat.double() * z_hat[..., None]], -1)  # [R, H, 1 + D]
    exact = torch.cat([torch.ones_like(lse[0, :, None]).double(), o[0].double()], -1)
    mean, se = est.mean(0), est.std(0) / math.sqrt(reps)
    # Draws of rare, heavy entries make the sample std small for a while: allow 1e-3 on top.
    tol = Z_SCORE * se + 1e-3 * (1 + exact.abs())
    worst = ((mean - exact).abs() - tol).argmax()
    msg = f"mean {mean.flatten()[worst]} exact {exact.flatten()[worst]} se {se.flatten()[worst]}"
    assert bool(((mean - exact).abs() <= tol).all()), msg


@STAT_SETTINGS
@given(data=st.data(), args=ssa_args(temperatures=(1.0, 2.0), min_sample=1))
def test_estimates_are_unbiased(data, cases, args):
    case = data.draw(cases(max_prompt=40, max_steps=4))
    row = data.draw(st.integers(0, case.b - 1))
    check_unbiased(case, row, SSA(page=case.page, **args), reps=800)


@pytest.mark.parametrize("scheme", ["with_replacement", "gumbel_topk"])
@pytest.mark.parametrize("proxy", ["page", "exact"])
def test_estimates_are_unbiased_small_residual(make_case, scheme, proxy):
    """Few residual entries and several draws: where ``m·p`` and ``1 − (1 − p)^m`` differ most."""
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=22, steps=2, starts=[1], seed=11, sharp=0.5)
    sample = 8 if proxy == "page" else 3  # 2 draws of pages, or 3 draws of tokens
    policy = SSA(budget=4, sample=sample, proxy=proxy, page=4, sinks=0, window=1, scheme=scheme, seed=5)
    check_unbiased(case, 0, policy, reps=4000)


@pytest.mark.parametrize("scheme", ["with_replacement", "gumbel_topk"])
def test_hash_generator_estimates_are_unbiased(make_case, scheme):
    """The default (hash) generator, one call per draw: the counter gives each call new uniforms."""
    case = make_case(b=1, h_kv=2, g=2, d=8, page=4, prompt=30, steps=2, starts=[0], seed=3, sharp=0.5)
    policy = SSA(budget=4, sample=8, page=4, sinks=0, window=1, scheme=scheme, seed=1)
    state = case.state()
    o, lse = attend_state(state, case.q, Dense().select(state, case.q))
    reps, est = 600, []
    for _ in range(reps):
        o_hat, lse_hat = attend_state(state, case.q, policy.select(state, case.q))
        z_hat = torch.exp(lse_hat.double() - lse.double())
        est.append(torch.cat([z_hat[..., None], o_hat.double() * z_hat[..., None]], -1)[0])
    est = torch.stack(est)
    exact = torch.cat([torch.ones_like(lse[0, :, None]).double(), o[0].double()], -1)
    mean, se = est.mean(0), est.std(0) / math.sqrt(reps)
    assert bool((se > 0).all())  # the draws differ from call to call
    assert bool(((mean - exact).abs() <= Z_SCORE * se + 1e-3 * (1 + exact.abs())).all())


def _independent_pi(case, state, q, policy: SSA, det) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling distribution and with-replacement π per (KV head, entry) for row 0, recomputed."""
    c = state.cache
    g, h_kv = case.g, case.h_kv
    if policy.proxy == "page":
        raw = reference.quest_page_bound(q[:1], c.page_min[0][:1], c.page_max[0][:1], case.scale)[0].double()
        valid = (c.page_counts()[0] > 0)
        n_draws = -(-policy.sample // case.page) if isinstance(policy.sample, int) else None
    else:
        qg = q[:1].double().view(h_kv, g, case.d)
        raw = torch.einsum("kgd,knd->kgn", qg, c.keys[0][0].double()).reshape(h_kv * g, -1) * case.scale
        valid = c.token_valid()[0]
        n_draws = policy.sample if isinstance(policy.sample, int) else None
    n_units = valid.numel()
    if n_draws is None:
        n_draws = math.ceil(policy.sample * int(valid.sum()) - 1e-9)
    n_draws = min(n_draws, n_units)
    raw = raw.view(h_kv, g, -1) / policy.temperature
    in_det = torch.zeros(h_kv, n_units, dtype=torch.bool)
    for hk in range(h_kv):
        in_det[hk, det.indices[0, hk, : int(det.count[0, hk])].long()] = True
    residual = valid[None, :] & ~in_det
    masked = raw.masked_fill(~residual[:, None, :], -torch.inf)
    p = torch.softmax(masked, -1).nan_to_num(0.0).mean(1)  # the group's mixture
    return p, 1 - (1 - p) ** n_draws


@STAT_SETTINGS
@given(data=st.data(), args=ssa_args(schemes=("with_replacement",), min_sample=1))
def test_inclusion_probabilities_match_frequencies(data, cases, args):
    case = data.draw(cases(max_prompt=40, max_steps=4))
    check_inclusion(case, SSA(page=case.page, **args), reps=1500)


@pytest.mark.parametrize("proxy", ["page", "exact"])
def test_inclusion_probabilities_several_draws(make_case, proxy):
    case = make_case(b=1, h_kv=2, g=2, d=8, page=4, prompt=30, steps=2, starts=[3], seed=4, sharp=1.0)
    sample = 12 if proxy == "page" else 3  # 3 draws either way
    check_inclusion(case, SSA(budget=8, sample=sample, proxy=proxy, page=4, sinks=1, window=2, seed=9), reps=4000)


def check_inclusion(case, policy: SSA, reps: int) -> None:
    """Empirical inclusion frequencies of the sampled entries are ``π = 1 − (1 − p)^m``, and
    the weights are ``−log π``; ``p`` and ``π`` are recomputed independently."""
    args = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    state, q = replicate(case, 0, reps)
    sel = own_draws(policy).select(state, q)
    det = SSA(**{**args, "sample": 0}).select(state, q)
    p, pi = _independent_pi(case, state, q, policy, det)  # [H_kv, N]
    n = p.shape[-1]
    hits = torch.zeros(reps, case.h_kv, n + 1)
    slots = torch.arange(sel.k_max)
    is_sampled = (slots >= det.count[..., None]) & (slots < sel.count[..., None])
    hits.scatter_(2, torch.where(is_sampled, sel.indices.long(), n), 1.0)
    freq = hits[..., :n].mean(0).double()
    se = (pi * (1 - pi) / reps).sqrt()
    assert bool(((freq - pi).abs() <= Z_SCORE * se + 1e-3).all()), f"{(freq - pi).abs().max()}"
    # The weight of every sampled entry is −log π of that entry.
    lw = sel.log_weight.double()
    expect = -torch.log(torch.gather(pi[None].expand(reps, -1, -1), 2, sel.indices.long()))
    assert bool(torch.allclose(lw[is_sampled], expect[is_sampled], rtol=1e-4, atol=1e-5))


@STAT_SETTINGS
@given(data=st.data(), args=ssa_args(schemes=("gumbel_topk",), temperatures=(1.0, 2.0), min_sample=1))
def test_gumbel_conditional_weights_are_unbiased(data, cases, args):
    """Gumbel-top-k: ``E[1{j∈S}/π_j(κ)] = 1`` for every residual entry ``j``."""
    case = data.draw(cases(max_prompt=40, max_steps=4))
    reps = 2000
    state, q = replicate(case, 0, reps)
    policy = SSA(page=case.page, **args)
    sel = own_draws(policy).select(state, q)
    det = SSA(page=case.page, **{**args, "sample": 0}).select(state, q)
    p, pi_wr = _independent_pi(case, state, q, policy, det)
    n = p.shape[-1]
    slots = torch.arange(sel.k_max)
    is_sampled = (slots >= det.count[..., None]) & (slots < sel.count[..., None])
    inv = torch.zeros(reps, case.h_kv, n + 1, dtype=torch.float64)
    inv.scatter_(2, torch.where(is_sampled, sel.indices.long(), n), torch.exp(sel.log_weight.double()))
    est = inv[..., :n]
    # Entries drawn rarely have heavy-tailed weights (the sample std misjudges them): check the
    # ones a with-replacement scheme would include at least 5% of the time (fewer than Gumbel-top-k).
    common = pi_wr >= 0.05
    mean, se = est.mean(0), est.std(0) / math.sqrt(reps)
    err = (mean - 1.0).abs()[common]
    assert bool((err <= Z_SCORE * se[common] + 2e-3).all()), f"{err.max()}"


# ---------------------------------------------------------------------------------- hand-made
def test_single_residual_entry_is_certain(make_case, contract):
    """A residual of one entry is drawn with π = 1: weight 0, and attention is dense."""
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=12, steps=0, starts=[0], seed=5)
    for scheme in ("with_replacement", "gumbel_topk"):
        # 3 pages; the forced last page and one top page are deterministic, one page is left.
        sel = SSA(budget=8, sample=4, page=4, sinks=0, window=1, scheme=scheme).select(case.state(), case.q)
        assert int(sel.count[0, 0]) == 3 and float(sel.log_weight.abs().max()) == 0.0
        contract.check_reproduces_dense(sel, case)


def test_full_budget_needs_no_samples(make_case, contract):
    case = make_case(b=2, h_kv=2, g=2, d=8, page=4, prompt=20, steps=2, starts=[0, 3], seed=7, extra=3)
    for proxy in ("page", "exact"):
        sel = SSA(budget=1.0, sample=8, proxy=proxy, page=4).select(case.state(), case.q)
        assert float(sel.log_weight.abs().max()) == 0.0
        contract.check_reproduces_dense(sel, case)


def test_with_replacement_merges_duplicates(make_case):
    """Many draws from a small residual: entries are unique and ``count`` stays within K_max."""
    case = make_case(b=1, h_kv=1, g=1, d=8, page=1, prompt=10, steps=0, starts=[0], seed=2)
    sel = SSA(budget=2, sample=10, proxy="exact", sinks=0, window=0, seed=3).select(case.state(), case.q)
    got = sel.indices[0, 0, : int(sel.count[0, 0])].tolist()
    assert len(got) == len(set(got)) and sel.k_max == 12


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(budget=-1), ValueError, "budget"),
        (dict(budget=1.5), ValueError, "budget"),
        (dict(budget=True), TypeError, "budget"),
        (dict(sample=-3), ValueError, "sample"),
        (dict(sample=0.0), ValueError, "sample"),
        (dict(sample="8"), TypeError, "sample"),
        (dict(proxy="bound"), ValueError, "proxy"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(page=0), ValueError, "page"),
        (dict(sinks=-1), ValueError, "sinks"),
        (dict(window=1.0), TypeError, "window"),
        (dict(aggregate="mean"), ValueError, "aggregate"),
        (dict(scheme="poisson"), ValueError, "scheme"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(generator=3), TypeError, "generator"),
    ],
)
def test_ssa_rejects_bad_args(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        SSA(**kwargs)


def test_page_proxy_needs_matching_cache(make_case):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=8, steps=0, starts=[0], seed=0)
    with pytest.raises(ValueError, match="page_size"):
        SSA(page=8).select(case.state(), case.q)
    SSA(page=8, proxy="exact").select(case.state(), case.q)  # exact scores need no page size


@SETTINGS
@given(data=st.data(), args=ssa_args(), factor=st.sampled_from([1, 3]))
def test_rescored_strata_rank_pages_by_their_log_mass(data, cases, contract, args, factor):
    """With ``rescore`` the page proxy is each page's log softmax numerator: exact on the candidate
    pages; elsewhere the bound ``u_p + log n_p`` less its mean overshoot on the head's candidates."""
    if args["proxy"] != "page":
        return
    from policyzoo.kv.choose import page_log_mass
    from policyzoo.kv.scoring import page_bound_scores

    case = data.draw(cases())
    state = case.state()
    policy = SSA(page=case.page, **{**args, "rescore": factor})
    sel = policy.select(state, case.q)
    contract.check_entries(sel, case, args["sinks"], args["window"], pages=True)
    c = case.cache
    every = Selection(torch.arange(c.num_pages, dtype=torch.int32).expand(case.b, case.h_kv, -1).contiguous(),
                      torch.full((case.b, case.h_kv), c.num_pages, dtype=torch.int32), block=case.page)
    bounds = page_bound_scores(state, case.q)
    exact = page_log_mass(state, case.q, bounds, every)  # every page a candidate
    z = torch.einsum("bkgd,bknd->bkgn", case.q.double().view(case.b, case.h_kv, case.g, -1), c.keys[0].double()) * case.scale
    z = z.masked_fill(~c.token_valid()[:, None, None, :], -torch.inf).view(case.b, case.h_kv, case.g, c.num_pages, case.page)
    torch.testing.assert_close(exact, torch.logsumexp(z, -1).reshape(case.b, case.h, -1).float(), rtol=1e-4, atol=1e-4)
    half = Selection(every.indices[..., ::2].contiguous(), torch.full_like(every.count, (c.num_pages + 1) // 2), block=case.page)
    mixed = page_log_mass(state, case.q, bounds, half)
    torch.testing.assert_close(mixed[..., ::2], exact[..., ::2], rtol=1e-5, atol=1e-5)  # the candidates are exact
    mass = bounds + c.page_counts()[:, None, :].float().log()
    finite = (exact > -torch.inf)[..., ::2]
    over = torch.where(finite, (mass - exact)[..., ::2], 0.0).sum(-1, keepdim=True) / finite.sum(-1, keepdim=True).clamp(min=1)
    others = (mass - over)[..., 1::2]
    torch.testing.assert_close(mixed[..., 1::2][others > -torch.inf], others[others > -torch.inf], rtol=1e-5, atol=1e-5)
