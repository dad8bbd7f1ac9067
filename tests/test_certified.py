"""Tests of the certified dropped-mass bound (`policyzoo.kv.certified`)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder
from policyzoo.eval.audit import Audit
from policyzoo.eval.metrics import dropped_mass, group_mean
from policyzoo.kernels import reference
from policyzoo.kv import (
    SSA,
    AttentionTopK,
    Certified,
    Dense,
    EntmaxKV,
    Quest,
    Window,
    certified_dropped_mass,
    grow_until_certified,
)

SETTINGS = settings(max_examples=40, deadline=None)


def true_delta(case, sel) -> torch.Tensor:
    c = case.cache
    p = reference.dense_probs(case.q, c.keys[0], c.start, c.length, case.scale)
    return dropped_mass(p, sel, c.token_valid())


@st.composite
def any_selection_policy(draw, page: int, sketch: bool = False):
    kind = draw(st.sampled_from(["quest", "topk", "entmax", "window", "ssa0"]))
    budget = draw(st.integers(1, 60)) if draw(st.booleans()) else draw(st.floats(1e-3, 1.0))
    sinks, window = draw(st.integers(0, 6)), draw(st.integers(0, 12))
    rescore = draw(st.sampled_from([0, 0, 2]))  # two-stage: token selections (pages for SSA)
    bound = draw(st.sampled_from(["box", "sketch"])) if sketch else "box"  # ranking; the certificate uses the cache's best
    if kind == "quest":
        return Quest(budget=budget, page=page, sinks=sinks, window=window, rescore=rescore, bound=bound)
    if kind == "topk":
        budget = max(budget, sinks + window) if isinstance(budget, int) else budget
        return AttentionTopK(budget=budget, sinks=sinks, window=window, aggregate=draw(st.sampled_from(["sum", "max"])))
    if kind == "entmax":
        return EntmaxKV(budget=budget, page=page, sinks=sinks, window=window, mode=draw(st.sampled_from(["gaussian", "topk"])),
                        rescore=rescore, bound=bound)
    if kind == "window":
        return Window(sinks=sinks, window=max(window, 1))
    proxy = draw(st.sampled_from(["page", "exact"]))
    return SSA(budget=budget, sample=0, proxy=proxy, page=page, sinks=sinks, window=window,
               rescore=rescore if proxy == "page" else 0, bound=bound if proxy == "page" else "box")


@SETTINGS
@given(data=st.data())
def test_bound_holds_for_every_selection(data, cases, contract):
    """``δ ≤ U/(Z_S + U)`` per query head, for page and token selections of every policy, with the
    box's page bounds or (where the cache keeps the key sketch) each token's sketch bound."""
    case = data.draw(cases(dtypes=(torch.float32, torch.bfloat16), sketch=(False, True)))
    policy = data.draw(any_selection_policy(case.page, sketch=case.params["sketch"]))
    state = case.state()
    sel = policy.select(state, case.q)
    _, lse = contract.attend(case, sel)
    bound = certified_dropped_mass(state, case.q, sel, lse)
    delta = true_delta(case, sel)
    assert bound.shape == delta.shape == (case.b, case.h) and bound.dtype == torch.float32
    assert bool(((bound >= 0) & (bound <= 1)).all())
    assert bool((bound >= delta - 1e-6).all()), f"bound {bound} < delta {delta}"


@SETTINGS
@given(data=st.data())
def test_bound_of_dense_is_zero(data, cases, contract):
    case = data.draw(cases())
    sel = Dense().select(case.state(), case.q)
    _, lse = contract.attend(case, sel)
    assert bool((certified_dropped_mass(case.state(), case.q, sel, lse) == 0).all())


def test_bound_is_tight_for_constant_pages(make_case, contract):
    """When every key of a page is equal the page bound is the score, and the bound is δ."""
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=16, steps=0, starts=[0], seed=4)
    c = case.cache
    keys = torch.randn(1, 1, 4, 1, 8, generator=torch.Generator().manual_seed(0)).expand(1, 1, 4, 4, 8).reshape(1, 1, 16, 8)
    c.reset(torch.tensor([0]), 16)
    c.write_prefill(0, keys.contiguous(), keys.contiguous())
    sel = Quest(budget=8, page=4, sinks=0, window=0).select(case.state(), case.q)
    _, lse = contract.attend(case, sel)
    bound = certified_dropped_mass(case.state(), case.q, sel, lse, slack=0.0)
    torch.testing.assert_close(bound, true_delta(case, sel), rtol=1e-4, atol=1e-6)


def test_empty_selection_bounds_one(make_case, contract):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=8, steps=0, starts=[0], seed=0)
    sel = Quest(budget=4, page=4).select(case.state(), case.q)
    sel.count.zero_()
    _, lse = contract.attend(case, sel)
    assert bool((certified_dropped_mass(case.state(), case.q, sel, lse) == 1).all())


def test_weighted_selection_is_rejected(make_case, contract):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=24, steps=0, starts=[0], seed=0)
    sel = SSA(budget=4, sample=8, page=4, sinks=0, window=0).select(case.state(), case.q)
    _, lse = contract.attend(case, sel)
    with pytest.raises(ValueError, match="log_weight"):
        certified_dropped_mass(case.state(), case.q, sel, lse)


# -------------------------------------------------------------------------------------- guard
@SETTINGS
@given(
    data=st.data(),
    eps=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9, 1.0]),
    tokens=st.booleans(),
    sinks=st.integers(0, 4),
    window=st.integers(0, 8),
)
def test_grow_until_certified(data, cases, contract, eps, tokens, sinks, window):
    """The shortest certified prefix: its bound is ≤ eps (or it is the whole candidate list), it
    equals the bound computed from the kernel's lse, it is ≥ the true δ, and one entry less (above
    the minimum) would not certify; with the box's bounds or the key sketch's."""
    case = data.draw(cases(max_prompt=40, sketch=(False, True)))
    state = case.state()
    if tokens:
        wide = AttentionTopK(budget=1.0, sinks=sinks, window=window).select(state, case.q)
        low = AttentionTopK(budget=0.2, sinks=sinks, window=window).select(state, case.q).count
    else:
        wide = Quest(budget=1.0, page=case.page, sinks=sinks, window=window).select(state, case.q)
        low = Quest(budget=0.2, page=case.page, sinks=sinks, window=window).select(state, case.q).count
    sel, bound = grow_until_certified(state, case.q, wide, eps, min_count=low)
    assert torch.equal(sel.indices, wide.indices) and sel.block == wide.block
    assert bool((sel.count >= torch.minimum(low, wide.count)).all()) and bool((sel.count <= wide.count).all())
    _, lse = contract.attend(case, sel)
    direct = certified_dropped_mass(state, case.q, sel, lse)
    torch.testing.assert_close(bound, direct, rtol=1e-4, atol=1e-6)
    assert bool((bound >= true_delta(case, sel) - 1e-6).all())
    worst = bound.view(case.b, case.h_kv, case.g).amax(-1)
    assert bool(((worst <= eps + 1e-6) | (sel.count == wide.count)).all())
    # Minimality: cutting one more entry (when allowed) breaks the certificate.
    shorter = type(sel)(sel.indices, (sel.count - 1).clamp(min=0), block=sel.block)
    _, lse_s = contract.attend(case, shorter)
    b_s = certified_dropped_mass(state, case.q, shorter, lse_s).view(case.b, case.h_kv, case.g).amax(-1)
    cut = sel.count > low
    assert bool((b_s[cut] > eps - 1e-5).all())


def test_full_candidates_certify_zero(make_case):
    case = make_case(b=2, h_kv=2, g=2, d=8, page=4, prompt=20, steps=1, starts=[0, 6], seed=1, extra=2)
    wide = Dense().select(case.state(), case.q)
    sel, bound = grow_until_certified(case.state(), case.q, wide, 0.0)
    assert torch.equal(sel.count, wide.count) and bool((bound == 0).all())


@SETTINGS
@given(data=st.data(), eps=st.sampled_from([0.01, 0.2, 0.6]))
def test_certified_policy(data, cases, contract, eps):
    case = data.draw(cases(max_prompt=40, sketch=(False, True)))
    base = Quest(budget=0.25, page=case.page, sinks=2, window=4, bound="sketch" if case.params["sketch"] else "box")
    policy = Certified(base, eps=eps, max_budget=0.75)
    assert policy.page_size == case.page and policy.attention == "softmax"
    state = case.state()
    sel = policy.select(state, case.q)
    contract.check_entries(sel, case, 2, 4, pages=True)
    assert bool((sel.count >= base.select(state, case.q).count).all())
    bound = state.layer_state_of(policy).bound
    assert bool((bound >= true_delta(case, sel) - 1e-6).all())


def test_the_sketch_makes_the_bound_follow_delta(make_case, contract):
    """Keys in tight clusters, one of which the query hits: the box's bound of the selection that holds
    that cluster says little, the key sketch's is within a small factor of the true δ."""
    case = make_case(b=1, h_kv=2, g=2, d=32, page=8, prompt=256, steps=0, starts=[0], seed=5, sketch=True)
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(2, 32, 32, generator=gen)  # [H_kv, clusters, D]
    keys = (centres.repeat_interleave(8, 1) + 0.05 * torch.randn(2, 256, 32, generator=gen))[None]
    case.cache.reset(torch.tensor([0]), 256)
    case.cache.write_prefill(0, keys, keys)
    q = 4.0 * centres[:, 7].repeat_interleave(2, 0)[None]  # both heads of each group look for cluster 7
    case.q.copy_(q)
    state = case.state()
    sel = Quest(budget=0.25, page=8, sinks=0, window=0, bound="sketch").select(state, case.q)
    _, lse = contract.attend(case, sel)
    delta = true_delta(case, sel)
    tight = certified_dropped_mass(state, case.q, sel, lse)
    boxed = make_case(b=1, h_kv=2, g=2, d=32, page=8, prompt=256, steps=0, starts=[0], seed=5)
    boxed.cache.reset(torch.tensor([0]), 256)
    boxed.cache.write_prefill(0, keys, keys)
    loose = certified_dropped_mass(boxed.state(), case.q, sel, lse)
    assert bool((tight >= delta - 1e-6).all()) and bool((loose >= tight - 1e-6).all())
    assert float(delta.max()) < 1e-3 and float(tight.max()) < 0.05, (delta, tight, loose)


def test_certified_bound_is_written_in_place(make_case):
    """After prefill the per-step bound lives in one tensor (a compiled step must not see the layer's
    state change)."""
    case = make_case(b=2, h_kv=1, g=2, d=8, page=4, prompt=24, steps=1, starts=[0, 2], seed=3)
    policy = Certified(Quest(budget=8, page=4), eps=0.1)
    state = case.state()
    policy.prefill(state, case.q[:, :, None], None, None)
    kept = state.layer_state_of(policy).bound
    policy.select(state, case.q)
    assert state.layer_state_of(policy).bound is kept and bool((kept > 0).any())


def test_certified_rejects_bad_args():
    with pytest.raises(TypeError, match="budget"):
        Certified(Window(), eps=0.1)
    with pytest.raises(ValueError, match="eps"):
        Certified(Quest(), eps=1.5)
    with pytest.raises(ValueError, match="max_budget"):
        Certified(Quest(), max_budget=2.0)
    with pytest.raises(ValueError, match="sample=0"):  # at construction, not at the first decode step
        Certified(SSA(0.1, 0.05))
    assert Certified(SSA(0.1, 0)).policy.sample == 0
    with pytest.raises(ValueError, match=r"Certified\(EntmaxKV\(...\)\): the certificate bounds softmax"):
        Certified(EntmaxKV(attention="entmax"))
    with pytest.raises(ValueError, match="below the policy's own budget"):
        Certified(Quest(0.5), max_budget=0.1)
    assert Certified(Quest(0.5), max_budget=0.5).max_budget == 0.5


# -------------------------------------------------------------------------------------- audit
@SETTINGS
@given(data=st.data(), sample=st.sampled_from([0, 8]))
def test_audit_records_the_bound_of_page_selections(data, cases, contract, sample):
    """Quest and SSA (page proxy, with and without Horvitz–Thompson weights): the recorded bound is
    ≥ the recorded true δ, and it is the bound from the unweighted selection's lse."""
    case = data.draw(cases(page_sizes=(4, 16), dtypes=(torch.float32, torch.bfloat16)))
    policy = data.draw(st.sampled_from([
        Quest(budget=8, page=case.page, sinks=0, window=2),
        SSA(budget=8, sample=sample, page=case.page, sinks=0, window=2),
    ]))  # fmt: skip
    state = case.state()
    sel = policy.select(state, case.q)
    out, _ = contract.attend(case, sel)
    audit = Audit()
    audit.record_attention(0, case.q, case.cache, sel, out, case.scale)
    bound, delta = audit.certified_bound[0][0], audit.dropped_mass[0][0]
    assert bound.shape == delta.shape == (case.b, case.h_kv)
    assert bool((bound >= delta - 1e-6).all()), f"bound {bound} < delta {delta}"
    bare = type(sel)(sel.indices, sel.count, block=sel.block)
    _, lse = contract.attend(case, bare)
    expected = group_mean(certified_dropped_mass(state, case.q, bare, lse), case.h_kv)
    torch.testing.assert_close(bound, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "policy",
    [Quest(budget=8, page=4, sinks=0, window=4), SSA(budget=8, sample=8, page=4, sinks=0, window=4, seed=3)],
    ids=repr,
)
def test_generate_audit_reports_certified_bound_above_true_delta(policy, seed):
    """Through `Decoder.generate(audit=True)`: bound ≥ true δ at every layer, step, row and KV head."""
    dec = Decoder(tiny_model("llama", seed=seed), kv=policy)
    ids, mask = padded_batch(2, 37, seed=seed)
    dec.generate(ids, 6, attention_mask=mask, audit=True)
    bound, delta = dec.last_audit.per_layer("certified_bound"), dec.last_audit.per_layer("dropped_mass")
    assert bound.shape == delta.shape == (2, 5, 2, 2)  # layers, steps, batch, KV heads
    assert float(delta.max()) > 1e-3  # the policy drops mass: the comparison is not 0 ≥ 0
    assert bool((bound >= delta - 1e-6).all())


def test_audit_certifies_the_token_selection_of_a_two_stage_page_policy():
    """A rescored `Quest` keeps tokens, but its cache has page summaries: the bound (unselected
    tokens of partly kept pages bounded by their page) is recorded and holds."""
    dec = Decoder(tiny_model("llama"), kv=Quest(0.3, page=4, sinks=2, window=2, rescore=2))
    ids, mask = padded_batch(2, 21)
    dec.generate(ids, 5, attention_mask=mask, audit=True)
    bound, delta = dec.last_audit.per_layer("certified_bound"), dec.last_audit.per_layer("dropped_mass")
    assert bound.shape == delta.shape and float(delta.max()) > 1e-3
    assert bool((bound >= delta - 1e-6).all())


def test_audit_records_no_bound_for_token_selections():
    dec = Decoder(tiny_model("llama"), kv=AttentionTopK(8, sinks=2, window=2))
    ids, mask = padded_batch(2, 21)
    dec.generate(ids, 4, attention_mask=mask, audit=True)
    assert not dec.last_audit.certified_bound and math.isnan(dec.last_audit.mean("certified_bound"))
    assert dec.last_audit.dropped_mass
