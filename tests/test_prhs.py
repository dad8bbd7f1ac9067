"""Contract tests of `policyzoo.kv.PrHS` (selections reused along time and layers, a budget schedule
along depth, every reuse certified with ``eps``).

What PrHS promises: with ``eps=0`` it decodes like the policy it wraps, at full budget like dense
attention; every reuse it certifies drops at most ``eps`` of the softmax mass; a compiled step never
recompiles; the time axis reuses this layer's previous selection (with the newest entry added) while
every query head of the group stays within cosine ``τ`` of the query that made it; the layer axis
hands a follower the selection of the layer below; the depth axis scales each layer's budget and
window. Decoder-level tests run on the tiny random models of `tiny_models`; selection-level ones on
the `cases` caches of conftest, driven step by step as the attention hook drives them (`Drive`).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import LearnedQuest, padded_batch, tiny_model

from policyzoo import SSA, AttentionTopK, Certified, Decoder, Dense, DepthSchedule, EntmaxKV, PrHS, Quest, Window
from policyzoo.eval.aggregate import summarize_audit
from policyzoo.eval.metrics import dropped_mass
from policyzoo.kernels import reference
from policyzoo.kv.base import KVState
from policyzoo.kv.certified import certified_dropped_mass, certify_before_attention
from policyzoo.kv.context import ContextStore
from policyzoo.kv.prhs import extend_to_newest, merge, scaled_budget
from policyzoo.selection import REUSE_AXES, Selection
from policyzoo.spec import parse_kv

SETTINGS = settings(max_examples=20, deadline=None)  # selection-level properties (milliseconds each)
DECODES = settings(max_examples=10, deadline=None)  # decoder-level properties (a decode of 6 tokens each)
TIME, LAYER = 1 + REUSE_AXES.index("time"), 1 + REUSE_AXES.index("layer")


# ------------------------------------------------------------------------------------ helpers
@functools.cache
def llama(layers: int = 2):
    return tiny_model("llama", layers=layers)


def prompt(seed: int, repeated: bool, length: int = 29) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded rows (row 1 has 3 pads); ``repeated``: each row is its last token repeated,
    so consecutive queries are alike (time reuse becomes likely)."""
    ids, mask = padded_batch(2, length, seed=seed)
    if repeated:
        ids = ids[:, -1:].expand(-1, length) * mask
    return ids, mask


def small_quest(**kw) -> Quest:
    return Quest(0.3, page=4, sinks=2, window=4, **kw)


# The policies PrHS wraps in the decoder-level tests: budgets small enough that they never keep every
# token of a 29-token prompt (see test_eps_zero_reuses_a_lossless_selection_the_wrapped_policy_would_not_make).
WRAPPED = {
    "quest": small_quest,
    "attn-topk": lambda: AttentionTopK(0.3, sinks=2, window=4),
    "quest-rescore": lambda: small_quest(rescore=2),
}


@functools.cache
def wrapped_tokens(name: str, seed: int, repeated: bool) -> torch.Tensor:
    ids, mask = prompt(seed, repeated)
    return Decoder(llama(), kv=WRAPPED[name]()).generate(ids, 6, attention_mask=mask)


def true_delta(cache, layer: int, q: torch.Tensor, scale: float, sel: Selection) -> torch.Tensor:
    """``float[B, H]``: the softmax mass of dense attention that ``sel`` drops (per query head)."""
    p = reference.dense_probs(q, cache.keys[layer], cache.start, cache.length, scale)
    return dropped_mass(p, sel, cache.token_valid())


def entries(sel: Selection, row: int, head: int) -> list[int]:
    return sel.indices[row, head, : int(sel.count[row, head])].tolist()


def same_entries(a: Selection, b: Selection) -> bool:
    return torch.equal(a.count, b.count) and all(
        entries(a, r, h) == entries(b, r, h) for r in range(a.count.shape[0]) for h in range(a.count.shape[1])
    )


class Drive:
    """Decode steps of ``policy`` over a `Case` cache by hand, in the order the attention hook runs
    them: at the prefill's end each layer's `prefill` and, when the policy reads ``previous``, the
    selection for the prompt's last query; per step the new token's write and `append`, `select`,
    and `ContextStore.record` (the next layer's ``below``, the next step's ``previous``)."""

    def __init__(self, policy, case) -> None:
        self.policy, self.case = policy, case
        cache = case.cache
        self.contexts = ContextStore(cache.num_layers, "cpu")
        self.contexts.keep_previous = "previous" in policy.step_context
        self.states = [KVState(cache, layer, case.scale, contexts=self.contexts) for layer in range(cache.num_layers)]
        self.gen = torch.Generator().manual_seed(case.params["seed"] + 1)

    def query(self, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(self.case.q.shape, generator=self.gen) * scale

    def prefill(self, q: torch.Tensor) -> None:
        self.contexts.reset()
        for state in self.states:
            self.policy.prefill(state, q[:, :, None], None, None)
            if self.contexts.keep_previous:
                self.contexts.seed_previous(state.layer, self.policy.select(state, q))

    def step(self, qs: list[torch.Tensor], write: bool = True) -> list[Selection]:
        cache = self.case.cache
        if write:
            cache.length += 1
        out = []
        for state, q in zip(self.states, qs):
            if write:
                shape = (cache.batch, cache.num_kv_heads, 1, cache.head_dim)
                k, v = (torch.randn(shape, generator=self.gen).to(cache.dtype) for _ in range(2))
                cache.write(state.layer, k, v)
                self.policy.append(state, k, v)
            sel = self.policy.select(state, q)
            self.contexts.record(state.layer, sel)
            out.append(sel)
        self.contexts.end_step()
        self.contexts.advance()
        return out


# ----------------------------------------------------------------------- exactness: eps=0, full budget
@DECODES
@given(
    name=st.sampled_from(list(WRAPPED)),
    tau=st.floats(0.01, 1.0),
    layer=st.sampled_from([(), (0, 0)]),
    seed=st.integers(0, 2),
    repeated=st.booleans(),
)
@example(name="quest", tau=0.3, layer=(0, 0), seed=2, repeated=False)  # every wrapped policy, always
@example(name="attn-topk", tau=0.3, layer=(0, 0), seed=2, repeated=False)
@example(name="quest-rescore", tau=0.3, layer=(0, 0), seed=2, repeated=False)
def test_eps_zero_decodes_like_the_wrapped_policy(name, tau, layer, seed, repeated):
    """``eps=0`` certifies only a reuse that drops nothing: the tokens are the wrapped policy's, for
    any ``τ``, with or without layer groups, on two left-padded rows. (The explicit examples are
    those where reuse without the certificate changes the tokens: the next test.)"""
    ids, mask = prompt(seed, repeated)
    policy = PrHS(WRAPPED[name](), eps=0, time=tau, layer=layer)
    got = Decoder(llama(), kv=policy).generate(ids, 6, attention_mask=mask)
    assert torch.equal(got, wrapped_tokens(name, seed, repeated))


@pytest.mark.parametrize("name", list(WRAPPED))
def test_uncertified_reuse_changes_the_tokens(name):
    """The test above has power: its explicit examples' reuses, uncertified, decode other tokens."""
    ids, mask = prompt(2, repeated=False)
    got = Decoder(llama(), kv=PrHS(WRAPPED[name](), time=0.3, layer=(0, 0))).generate(ids, 6, attention_mask=mask)
    assert not torch.equal(got, wrapped_tokens(name, 2, False))


def test_eps_zero_never_reuses_even_a_lossless_selection():
    """AttentionTopK(0.9) keeps every token of a context of up to 9; at the 10th its selection of the
    9 plus the newest token drops nothing (certified at eps=0) but the fresh one keeps 9 of 10."""
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    policy = AttentionTopK(0.9, sinks=0, window=0)
    want = Decoder(llama(), kv=policy).generate(ids, 6)
    got = Decoder(llama(), kv=PrHS(policy, eps=0, time=0.01)).generate(ids, 6)
    assert torch.equal(got, want)


@pytest.mark.parametrize("eps", [None, 0.5])
def test_full_budget_with_time_and_layer_reuse_decodes_like_dense(eps):
    """Every selection of `Quest(1.0)` holds every visible page, and so does any reuse of one (the
    newest page added): tokens and logits are dense attention's, as for Quest itself
    (test_decoder.test_full_budget_reproduces_dense). With ``eps`` the reuses certify (bound 0)."""
    ids, mask = prompt(0, repeated=True)
    dense, dense_logits = Decoder(llama()).generate(ids, 6, attention_mask=mask, output_logits=True)
    dec = Decoder(llama(), kv=PrHS(Quest(1.0, page=4), eps=eps, time=0.05, layer=(0, 0)))
    seq, logits = dec.generate(ids, 6, attention_mask=mask, output_logits=True, audit=True)
    assert torch.equal(seq, dense)
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)
    audit = dec.last_audit
    assert audit.mean("reuse_time") > 0 and audit.mean("reuse_layer") > 0  # the reuses did happen


# --------------------------------------------------------------------------------- certified reuse
@SETTINGS
@given(data=st.data())
def test_certify_before_attention_bounds_the_true_dropped_mass(data, cases, contract):
    """For any selection (a policy's, and one made for another query then extended to the newest
    entry, as a time reuse is), the bound computed before attending is >= the true δ and equals
    the bound from the attention kernel's lse."""
    case = data.draw(cases(dtypes=(torch.float32, torch.bfloat16), sketch=(False, True)))
    budget = data.draw(st.sampled_from([0.1, 0.3, 0.6, 1.0, 8]))
    sinks, window = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 8))
    bound = "sketch" if case.params["sketch"] else "box"
    policy = data.draw(st.sampled_from([
        Quest(budget, page=case.page, sinks=sinks, window=window, bound=bound),
        Quest(budget, page=case.page, sinks=sinks, window=window, rescore=2),
        AttentionTopK(float(budget) if isinstance(budget, float) else max(budget, sinks + window), sinks=sinks, window=window),
    ]))  # fmt: skip
    state = case.state()
    sel = policy.select(state, case.q)
    older = policy.select(state, torch.randn(case.q.shape, generator=torch.Generator().manual_seed(1)).to(case.q.dtype))
    for s in (sel, extend_to_newest(older, state)[0]):
        bound = certify_before_attention(state, case.q, s)
        delta = true_delta(case.cache, 0, case.q, case.scale, s)
        assert bound.shape == (case.b, case.h) and bound.dtype == torch.float32
        assert bool(((bound >= 0) & (bound <= 1)).all())
        assert bool((bound >= delta - 1e-6).all()), f"bound {bound} < delta {delta}"
        _, lse = contract.attend(case, s)
        torch.testing.assert_close(bound, certified_dropped_mass(state, case.q, s, lse), rtol=1e-4, atol=1e-5)


def reused_deltas(audit) -> tuple[torch.Tensor, torch.Tensor]:
    """``(δ, certified bound)`` of the (layer, step, row, KV head) records that reused a selection."""
    reused = (audit.per_layer("reuse_time") + audit.per_layer("reuse_layer")) > 0
    return audit.per_layer("dropped_mass")[reused], audit.per_layer("certified_bound")[reused]


@DECODES
@given(
    eps=st.floats(0.2, 1.0),
    tau=st.floats(0.05, 1.0),
    layer=st.sampled_from([(), (0, 0)]),
    seed=st.integers(0, 2**16),
    repeated=st.booleans(),
    bound=st.sampled_from(["box", "sketch"]),
)
def test_every_certified_reuse_drops_at_most_eps(eps, tau, layer, seed, repeated, bound):
    """End to end: wherever the audit says a KV head reused a selection, its true δ (the group mean
    of the query heads', each certified <= eps) is <= eps; certified by the box or the key sketch."""
    ids, mask = prompt(seed, repeated)
    dec = Decoder(llama(), kv=PrHS(Quest(0.5, page=4, bound=bound), eps=eps, time=tau, layer=layer))
    dec.generate(ids, 6, attention_mask=mask, audit=True)
    delta, bound = reused_deltas(dec.last_audit)
    assert bool((delta <= eps + 1e-5).all()), f"reused with delta {delta.max()} > eps {eps}"
    assert bool((bound <= eps + 1e-4).all())  # the audit's bound (from the kernel's lse) agrees


def test_certified_reuse_happens_and_drops_mass_below_eps():
    """The property above is not vacuous: at eps=0.5 both axes reuse, with δ well above 0."""
    eps, reused, rates = 0.5, [], []
    for seed in range(3):
        ids, mask = prompt(seed, repeated=True)
        dec = Decoder(llama(), kv=PrHS(Quest(0.5, page=4), eps=eps, time=0.3, layer=(0, 0)))
        dec.generate(ids, 8, attention_mask=mask, audit=True)
        audit = dec.last_audit
        rates.append((audit.mean("reuse_time"), audit.mean("reuse_layer")))
        reused.append(reused_deltas(audit)[0])
    assert max(t for t, _ in rates) > 0 and max(layer for _, layer in rates) > 0
    delta = torch.cat(reused)
    assert bool((delta <= eps + 1e-5).all())
    assert float(delta.max()) > 0.1  # reuses that drop mass, not only lossless ones


@DECODES
@given(
    eps=st.floats(0.05, 0.9),  # a tiny random model's attention is flat: small eps keep nearly everything
    headroom=st.sampled_from([0.5, 1.0]),
    tau=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
    repeated=st.booleans(),
    bound=st.sampled_from(["box", "sketch"]),
)
def test_around_an_uncapped_certified_policy_every_record_drops_at_most_eps(eps, headroom, tau, seed, repeated, bound):
    """The dropped mass controlled in advance on every step, not only on reuses: fresh selections grow
    until certified at ``headroom·eps`` (no cap: the whole context certifies at 0), reuses are
    certified at ``eps``, so every (layer, step, row, KV head) record has true δ <= eps."""
    ids, mask = prompt(seed, repeated)
    fresh = Certified(Quest(0.2, page=4, sinks=1, window=4, bound=bound), eps=eps * headroom, max_budget=1.0)
    dec = Decoder(llama(), kv=PrHS(fresh, eps=eps, time=tau))
    dec.generate(ids, 6, attention_mask=mask, audit=True)
    delta = dec.last_audit.per_layer("dropped_mass")
    assert bool((delta <= eps + 1e-5).all()), f"a record dropped {delta.max()} > eps {eps}"
    assert bool((dec.last_audit.per_layer("certified_bound") <= eps + 1e-4).all())


def test_around_an_uncapped_certified_policy_records_drop_mass_keep_less_and_reuse():
    """The property above is not vacuous: at eps=0.6 the selections keep part of the context, reuse
    along time, and drop real mass, all under eps."""
    eps, deltas = 0.6, []
    for seed, repeated in ((0, False), (1, True)):
        ids, mask = prompt(seed, repeated)
        fresh = Certified(Quest(0.2, page=4, sinks=1, window=4, bound="sketch"), eps=eps / 2, max_budget=1.0)
        dec = Decoder(llama(), kv=PrHS(fresh, eps=eps, time=0.3))
        dec.generate(ids, 6, attention_mask=mask, audit=True)
        audit = dec.last_audit
        assert audit.mean("kv_keep") < 0.9 and audit.mean("reuse_time") > 0
        deltas.append(audit.per_layer("dropped_mass").flatten())
    delta = torch.cat(deltas)
    assert bool((delta <= eps + 1e-5).all()) and float(delta.max()) > 0.1


# ------------------------------------------------------------------------------------ compile
def test_all_three_axes_with_eps_compile_once_over_50_steps():
    """Every reuse decision is a device mask: 50 compiled steps with time, depth and layer reuse
    and certification replay one graph, and choose the eager tokens."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 17)

    def policy():
        return PrHS(small_quest(), eps=0.9, time=0.3, depth=DepthSchedule((0.5, 0.5), (4, 4)), layer=(0, 0))

    dec = Decoder(copy.deepcopy(model), kv=policy())
    eager = dec.generate(ids, 51, attention_mask=mask, audit=True)  # 50 steps after the prefill's token
    assert dec.last_audit.mean("reuse_time") > 0 and dec.last_audit.mean("reuse_layer") > 0  # the test has power
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=policy(), compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = dec.generate(ids, 51, attention_mask=mask)
    assert dec.session.compiled
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0


# ------------------------------------------------------------------------------ extend_to_newest, merge
@SETTINGS
@given(data=st.data(), pages=st.booleans(), weighted=st.booleans())
def test_extend_to_newest_adds_the_newest_entry_when_there_is_room(data, cases, pages, weighted):
    """Any selection of visible entries (in any order; its padding holding the newest id, which must
    not count): the result keeps every entry in place and adds the newest token (the newest page,
    for a page selection) where missing and room is left; ``fits`` is False only where it is
    missing and the selection is full. The added entry has log weight 0."""
    case = data.draw(cases(page_sizes=(1, 4, 16)))
    block = case.page if pages else 1
    newest = (case.length - 1) // block
    visible = [case.visible_pages(r) if pages else case.visible_tokens(r) for r in range(case.b)]
    k_max = data.draw(st.integers(1, max(map(len, visible)) + 2))
    indices = torch.full((case.b, case.h_kv, k_max), newest, dtype=torch.int32)
    count = torch.zeros(case.b, case.h_kv, dtype=torch.int32)
    chosen = {}
    for r in range(case.b):
        for h in range(case.h_kv):
            got = data.draw(st.lists(st.sampled_from(visible[r]), unique=True, max_size=k_max))
            indices[r, h, : len(got)] = torch.tensor(got, dtype=torch.int32)
            count[r, h], chosen[r, h] = len(got), got
    weight = torch.randn(indices.shape, generator=torch.Generator().manual_seed(case.params["seed"])) if weighted else None
    sel = Selection(indices, count, weight, block=block)
    out, fits = extend_to_newest(sel, case.state())
    assert out.block == block and out.indices.shape == sel.indices.shape and out.reuse is None
    assert out.indices.dtype == out.count.dtype == torch.int32 and fits.dtype == torch.bool and fits.shape == count.shape
    for (r, h), old in chosen.items():
        new, held, full = entries(out, r, h), newest in old, len(old) == k_max
        assert new[: len(old)] == old, "an earlier entry moved or went"
        assert new == (old if held or full else old + [newest])
        assert bool(fits[r, h]) == (held or not full)
        if weighted:
            assert torch.equal(out.log_weight[r, h, : len(old)], weight[r, h, : len(old)])
            if len(new) > len(old):
                assert float(out.log_weight[r, h, len(old)]) == 0.0
        else:
            assert out.log_weight is None


@SETTINGS
@given(
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    k=st.integers(1, 6),
    weighted=st.booleans(),
    axis=st.sampled_from([TIME, LAYER]),
    seed=st.integers(0, 2**16),
)
def test_merge_picks_per_row_and_kv_head_and_tags_the_reuse(b, h_kv, k, weighted, axis, seed):
    gen = torch.Generator().manual_seed(seed)

    def sel() -> Selection:
        weight = torch.randn(b, h_kv, k, generator=gen) if weighted else None
        return Selection(torch.randint(0, 50, (b, h_kv, k), generator=gen, dtype=torch.int32),
                         torch.randint(0, k + 1, (b, h_kv), generator=gen, dtype=torch.int32), weight, block=4)  # fmt: skip

    reused, fresh = sel(), sel()
    use = torch.rand(b, h_kv, generator=gen) < 0.5
    out = merge(use, reused, fresh, axis)
    assert out.block == 4 and out.reuse.dtype == torch.int8
    assert torch.equal(out.reuse, use.to(torch.int8) * axis)
    for r in range(b):
        for h in range(h_kv):
            src = reused if use[r, h] else fresh
            assert torch.equal(out.indices[r, h], src.indices[r, h]) and out.count[r, h] == src.count[r, h]
            if weighted:
                assert torch.equal(out.log_weight[r, h], src.log_weight[r, h])
    assert (out.log_weight is None) == (not weighted)


@pytest.mark.parametrize(
    "other",
    [
        Selection(torch.zeros(1, 2, 5, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32), block=4),  # width
        Selection(torch.zeros(1, 2, 3, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32), block=1),  # block
        Selection(torch.zeros(1, 2, 3, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32), torch.zeros(1, 2, 3), block=4),
    ],
    ids=["width", "block", "weights"],
)
def test_merge_refuses_selections_of_another_layout(other):
    fresh = Selection(torch.zeros(1, 2, 3, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32), block=4)
    with pytest.raises(ValueError, match="layout of a fresh one"):
        merge(torch.ones(1, 2, dtype=torch.bool), other, fresh, TIME)


# ------------------------------------------------------------------------------------ layer axis
def test_followers_return_the_selection_of_the_layer_below(make_case):
    """Without eps a follower does not run its policy: it hands on the layer below's selection,
    tagged as a layer reuse; a group's leader selects afresh (its own keys, its own query)."""
    case = make_case(b=2, h_kv=2, g=2, d=16, page=4, prompt=40, steps=0, starts=[0, 5], seed=1, extra=8, num_layers=4)
    policy = PrHS(small_quest(), layer=(0, 0, 0, 1))
    drive = Drive(policy, case)
    drive.prefill(case.q)
    for _ in range(3):
        qs = [drive.query() for _ in range(4)]
        sels = drive.step(qs)
        own = [small_quest().select(state, q) for state, q in zip(drive.states, qs)]
        for layer in (0, 3):
            assert same_entries(sels[layer], own[layer])
            assert sels[layer].reuse is None or not bool(sels[layer].reuse.any())
        for layer in (1, 2):
            assert torch.equal(sels[layer].indices, sels[0].indices) and torch.equal(sels[layer].count, sels[0].count)
            assert bool((sels[layer].reuse == LAYER).all())
        assert not same_entries(own[1], own[0])  # a follower's own choice differs: the test has power


@pytest.mark.parametrize(
    "time",
    [
        0.99,
        None,
    ],
)
def test_the_audit_reports_the_followers_share_as_the_layer_reuse_rate(time):
    """Layers (0, 0, 1): one follower out of three layers, every step, row and KV head."""
    ids, mask = prompt(0, repeated=False)
    dec = Decoder(llama(3), kv=PrHS(small_quest(), time=time, layer=(0, 0, 1)))
    dec.generate(ids, 5, attention_mask=mask, audit=True)
    audit = dec.last_audit
    assert audit.mean("reuse_layer") == pytest.approx(1 / 3)
    assert summarize_audit(audit)["reuse_layer"] == pytest.approx(1 / 3)
    per_layer = audit.per_layer("reuse_layer")  # [layers, steps, B, H_kv]
    assert per_layer.shape[0] == 3 and bool((per_layer[1] == 1).all()) and bool((per_layer[[0, 2]] == 0).all())


@SETTINGS
@given(data=st.data(), eps=st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]))
def test_with_eps_a_follower_reuses_the_layer_below_only_where_certified(data, cases, eps):
    """Per (row, KV head): the layer below's selection where its bound for the follower's query is
    <= eps on every query head of the group (and then the true δ is too), else the follower's own."""
    case = data.draw(cases(page_sizes=(4, 16), num_layers=2))
    policy = PrHS(Quest(0.5, page=case.page, sinks=1, window=2), eps=eps, layer=(0, 0))
    drive = Drive(policy, case)
    q1 = drive.query(data.draw(st.sampled_from([0.5, 1.0, 3.0])))
    below, sel = drive.step([case.q, q1], write=False)
    state = drive.states[1]
    own = policy.policy.select(state, q1)
    bound = certify_before_attention(state, q1, below)
    use = (bound.view(case.b, case.h_kv, case.g).amax(-1) <= eps) & (eps > 0)  # eps=0 never reuses
    assert torch.equal(sel.reuse, use.to(torch.int8) * LAYER)
    assert torch.equal(sel.count, torch.where(use, below.count, own.count))
    assert torch.equal(sel.indices, torch.where(use[..., None], below.indices, own.indices))
    delta = true_delta(case.cache, 1, q1, case.scale, sel).view(case.b, case.h_kv, case.g).amax(-1)
    assert bool((delta[use] <= eps + 1e-6).all())


# ------------------------------------------------------------------------------------- time axis
def test_time_reuse_keeps_the_query_that_made_the_selection(make_case):
    """A layer reuses its previous selection (plus the newest page) per KV head while every query
    head of the group is within cosine τ of the query that made it; the reference query stays that
    one through the reuses and becomes the new query where the group selects afresh."""
    case = make_case(b=2, h_kv=2, g=2, d=16, page=4, prompt=30, steps=0, starts=[0, 3], seed=3, extra=8)
    policy = PrHS(Quest(0.3, page=4, sinks=1, window=2), time=0.9)
    drive = Drive(policy, case)
    state = drive.states[0]
    drive.prefill(drive.query())
    made = state.layer_state_of(policy).query
    q = drive.query()

    (sel,) = drive.step([q])  # the previous query is far (or unset): fresh
    assert torch.equal(sel.reuse, torch.zeros_like(sel.reuse)) and torch.equal(made, q)
    for _ in range(2):  # near queries: reused, the reference query unchanged
        previous = copy.deepcopy(state.context.previous)
        (sel,) = drive.step([q + 0.02 * drive.query()])
        assert bool((sel.reuse == TIME).all()) and torch.equal(made, q)
        assert same_entries(sel, extend_to_newest(previous, state)[0])
    # head 0 (of KV head 0's group) turns away: that group selects afresh, the other keeps reusing
    turned = q.clone()
    turned[:, 0] = -q[:, 0]
    (sel,) = drive.step([turned])
    assert sel.reuse[:, 0].tolist() == [0, 0] and sel.reuse[:, 1].tolist() == [TIME, TIME]
    assert torch.equal(made[:, :2], turned[:, :2]) and torch.equal(made[:, 2:], q[:, 2:])
    fresh = policy.policy.select(state, turned)  # PrHS's are `extra` entries wider (padding past count)
    assert torch.equal(sel.indices[:, 0, : fresh.k_max], fresh.indices[:, 0]) and torch.equal(sel.count[:, 0], fresh.count[:, 0])
    assert sel.k_max == fresh.k_max + policy.extra // 4


@pytest.mark.parametrize("extra", [4, 8])
def test_a_reuse_grows_at_most_extra_tokens_past_the_budget_then_is_made_afresh(make_case, extra):
    """A reused selection gains the newest page when a page begins; it is kept while it holds at most
    ``extra`` tokens' worth of pages more than the policy's budget of the moment, however close the
    query, and is made afresh past that. The limit is the row's own: the selection is that much wider."""
    case = make_case(b=1, h_kv=1, g=2, d=16, page=4, prompt=30, steps=0, starts=[0], seed=5, extra=24)
    policy = PrHS(Quest(0.3, page=4, sinks=0, window=0), time=0.5, extra=extra)
    drive = Drive(policy, case)
    state = drive.states[0]
    drive.prefill(case.q)
    decided = []
    for _ in range(20):  # lengths 31..50: a new page every 4 tokens
        previous = copy.deepcopy(state.context.previous)
        (sel,) = drive.step([case.q])
        grown, fits = extend_to_newest(previous, state)  # with the step's token written
        budget = policy.policy.select(state, case.q).count
        within = bool(fits) and int(grown.count) <= int(budget) + extra // 4
        decided.append((within, int(sel.reuse)))
    assert all(reuse == (TIME if within else 0) for within, reuse in decided)
    assert {within for within, _ in decided} == {True, False}  # both cases happen


def audit_feeding(policy, ids, mask, tokens: list[torch.Tensor]):
    """The audit of decode steps that feed ``tokens`` (one ``[B]`` per step), not the chosen ones."""
    session = Decoder(llama(), kv=policy).session
    session.choose(session.prefill(ids, mask, capacity=ids.shape[1] + len(tokens))[:, -1])
    with session.audit() as audit:
        for step in tokens:
            session.step(step)
    return audit


def test_near_one_tau_and_random_queries_reuse_nothing_repeated_queries_reuse():
    ids, mask = prompt(0, repeated=False)
    random_tokens = list(torch.randint(1, 128, (8, 2), generator=torch.Generator().manual_seed(0)))
    assert audit_feeding(PrHS(small_quest(), time=0.999), ids, mask, random_tokens).mean("reuse_time") <= 0.01
    ids, mask = prompt(0, repeated=True)
    same = audit_feeding(PrHS(small_quest(), time=0.5), ids, mask, [ids[:, -1]] * 8)  # the prompt's token, again and again
    assert same.mean("reuse_time") > 0.3


def test_a_second_request_on_the_same_cache_reuses_like_the_first():
    ids = torch.full((1, 20), 126)
    dec = Decoder(llama(), kv=PrHS(Quest(0.3, page=4), time=0.5))
    first = dec.generate(ids, 5, audit=True)
    reuse_first = dec.last_audit.per_layer("reuse_time")
    second = dec.generate(ids, 5, audit=True)
    assert torch.equal(first, second)
    assert torch.equal(dec.last_audit.per_layer("reuse_time"), reuse_first)


def test_a_short_row_reuses_alike_next_to_a_much_longer_row():
    """Batch invariance (test_session.test_a_row_decodes_the_same_in_a_padded_batch_as_alone, whose
    prompts of up to 40 tokens keep K_max at its floor of forced pages) with a 60-token batchmate."""
    short, long = torch.full((4,), 29), torch.full((60,), 14)
    ids, mask = torch.zeros(2, 60, dtype=torch.long), torch.zeros(2, 60, dtype=torch.long)
    ids[0, -4:], mask[0, -4:] = short, 1
    ids[1], mask[1] = long, 1

    def policy():
        return PrHS(Quest(0.3, page=4, sinks=2, window=2), time=0.2)

    batched = Decoder(llama(), kv=policy())
    together = batched.generate(ids, 24, attention_mask=mask, audit=True)
    single = Decoder(llama(), kv=policy())
    alone = single.generate(short[None], 24, audit=True)
    reuse_batched, reuse_alone = batched.last_audit.per_layer("reuse_time")[:, :, :1], single.last_audit.per_layer("reuse_time")
    assert torch.equal(reuse_batched, reuse_alone)
    assert torch.equal(together[0, 60:], alone[0, 4:])


# ------------------------------------------------------------------------------------ depth axis
def test_policy_at_applies_the_layer_scale_and_window():
    depth = DepthSchedule((1.0, 0.5, 4.0), (0, 8, 32))
    ratio = PrHS(Quest(0.4, page=4, sinks=2, window=16), depth=depth)
    assert [ratio.policy_at(i) for i in range(3)] == [
        Quest(0.4, page=4, sinks=2, window=0), Quest(0.2, page=4, sinks=2, window=8), Quest(1.0, page=4, sinks=2, window=32)
    ]  # fmt: skip
    tokens = PrHS(AttentionTopK(64, sinks=2, window=16), depth=depth)
    assert [p.budget for p in map(tokens.policy_at, range(3))] == [64, 32, 256]
    plain = PrHS(small_quest())
    assert plain.policy_at(5) is plain.policy


@SETTINGS
@given(ratio=st.floats(1e-3, 1.0), tokens=st.integers(1, 10_000), scale=st.floats(1e-3, 10.0))
def test_scaled_budget_keeps_ratios_in_0_1_and_counts_at_least_1(ratio, tokens, scale):
    r = scaled_budget(ratio, scale)
    assert isinstance(r, float) and 0.0 < r <= 1.0 and r == pytest.approx(min(1.0, ratio * scale))
    n = scaled_budget(tokens, scale)
    assert isinstance(n, int) and n >= 1 and n == max(1, round(tokens * scale))


@SETTINGS
@given(data=st.data())
def test_each_layer_selects_with_its_depth_entry(data, cases):
    case = data.draw(cases(page_sizes=(4, 16), num_layers=2))
    policy = PrHS(Quest(0.5, page=case.page, sinks=1, window=4), depth=DepthSchedule((1.0, 0.3), (4, 9)))
    for layer, want in enumerate([Quest(0.5, page=case.page, sinks=1, window=4), Quest(0.15, page=case.page, sinks=1, window=9)]):
        state = case.state(layer)
        assert same_entries(policy.select(state, case.q), want.select(state, case.q))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(depth=DepthSchedule((1.0, 1.0, 1.0), (0, 0, 0))), "depth schedule has 3 layers, the model 2"),
        (dict(layer=(0, 0, 1)), "layer has 3 layers, the model 2"),
    ],
)
def test_a_schedule_for_another_depth_is_refused_at_prefill(kwargs, match):
    ids, mask = prompt(0, repeated=False)
    with pytest.raises(ValueError, match=match):
        Decoder(llama(), kv=PrHS(small_quest(), **kwargs)).generate(ids, 2, attention_mask=mask)


def test_depth_schedule_validation():
    with pytest.raises(ValueError, match="one scale and one window per layer"):
        DepthSchedule((1.0, 0.5), (4,))
    with pytest.raises(ValueError, match="one scale and one window per layer"):
        DepthSchedule((), ())
    with pytest.raises(ValueError, match="scales must be finite numbers > 0"):
        DepthSchedule((1.0, 0.0), (4, 4))
    with pytest.raises(ValueError, match="scales must be finite numbers > 0"):
        DepthSchedule((1.0, float("inf")), (4, 4))
    with pytest.raises(ValueError, match="windows must be ints >= 0"):
        DepthSchedule((1.0, 1.0), (4, -1))
    assert DepthSchedule([1, 2], [3, 4]).scale == (1.0, 2.0) and len(DepthSchedule((1,), (0,))) == 1


# ------------------------------------------------------------------------------ construction errors
@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: PrHS("quest"), TypeError, "policy must be a KV policy"),
        (lambda: PrHS(PrHS(small_quest())), TypeError, r"not a PrHS"),
        (lambda: PrHS(small_quest(), eps=-0.1), ValueError, "eps must be None or a number in \\[0, 1\\]"),
        (lambda: PrHS(small_quest(), eps=1.5), ValueError, "eps must be None or a number in \\[0, 1\\]"),
        (lambda: PrHS(small_quest(), eps=True), ValueError, "eps"),
        (lambda: PrHS(small_quest(), time=0.0), ValueError, "time .* in \\(0, 1\\]"),
        (lambda: PrHS(small_quest(), time=1.01), ValueError, "time .* in \\(0, 1\\]"),
        (lambda: PrHS(small_quest(), time="0.9"), ValueError, "time"),
        (lambda: PrHS(SSA(0.1, 0.05, page=4), eps=0.1), ValueError, "sample=0"),
        (lambda: PrHS(EntmaxKV(0.3, page=4, attention="entmax"), eps=0.1), ValueError, "entmax"),
        (lambda: PrHS(small_quest(), layer=(0, 1, 0)), ValueError, "non-decreasing"),
        (lambda: PrHS(small_quest(), layer=(0, 0.5)), TypeError, "int group ids"),
        (lambda: PrHS(Dense(), depth=DepthSchedule((1.0,), (0,))), ValueError, "Dense has no budget"),
        (lambda: PrHS(Window(), depth=DepthSchedule((1.0,), (0,))), ValueError, "Window has no budget"),
        (lambda: PrHS(small_quest(), depth=((1.0,), (0,))), TypeError, "DepthSchedule"),
        (lambda: PrHS(small_quest(), depth=DepthSchedule((1.0, 0.5), (4, 4)), layer=(0, 0)), ValueError, "share a selection"),
        (lambda: PrHS(small_quest(), depth=DepthSchedule((1.0, 1.0), (4, 4)), layer=(0, 0, 1)), ValueError, "layer has 3 entries"),
        (lambda: PrHS(small_quest(), slack=-1e-5), ValueError, "slack"),
    ],
)
def test_bad_arguments_are_refused_at_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_good_arguments_are_accepted():
    assert PrHS(SSA(0.1, 0.05, page=4), time=0.9).policy.sample == 0.05  # sampling weights without eps
    assert PrHS(SSA(0.1, 0, page=4), eps=0.1).eps == 0.1
    assert PrHS(EntmaxKV(0.3, page=4, attention="entmax"), time=0.9).attention == "entmax"
    p = PrHS(small_quest(), eps=0, time=1, depth=DepthSchedule((1.0, 1.0, 0.5), (4, 4, 8)), layer=(0, 0, 1))
    assert p.page_size == 4 and set(p.summaries) >= {"page_min", "page_max"}
    assert set(p.step_context) == {"previous", "below"} and PrHS(small_quest()).step_context == ()


# ------------------------------------------------------------------------------------- save, load
def policy_file(tmp_path, policy, name="prhs.safetensors"):
    return str(policy.save(tmp_path / name))


def test_save_and_load_round_trip(tmp_path):
    policy = PrHS(small_quest(rescore=2, aggregate="sum"), eps=0.3, time=0.7,
                  depth=DepthSchedule((1.0, 0.5), (6, 12)), layer=(0, 1), slack=1e-4)  # fmt: skip
    loaded = PrHS.load(policy_file(tmp_path, policy))
    assert loaded == policy and loaded.policy == policy.policy and type(loaded.policy) is Quest
    assert all(type(g) is int for g in loaded.layer) and all(type(w) is int for w in loaded.depth.window)
    plain = PrHS(AttentionTopK(16, sinks=2, window=4), time=0.5)  # no depth, no layer groups
    assert PrHS.load(policy_file(tmp_path, plain, "plain.safetensors")) == plain


def test_a_spec_path_loads_the_file_and_the_spec_overrides_it(tmp_path):
    policy = PrHS(small_quest(), eps=0.3, time=0.7, depth=DepthSchedule((1.0, 0.5), (6, 12)), layer=(0, 1))
    path = policy_file(tmp_path, policy)
    assert parse_kv(f"prhs:path={path}") == policy
    assert parse_kv(f"prhs:path={path},time=0.5") == replace(policy, time=0.5)
    swapped = parse_kv(f"prhs:[quest:0.2,page=4],path={path}")
    assert swapped == replace(policy, policy=Quest(0.2, page=4))
    assert swapped.policy_at(1) == Quest(0.1, page=4, window=12)  # the saved schedule on the new policy


def test_bad_policy_files_are_clear_errors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match="no policy file"):
        PrHS.load(missing)
    with pytest.raises(ValueError, match="no policy file"):
        parse_kv(f"prhs:path={missing}")
    other = str(LearnedQuest(0.3, page=4).save(tmp_path / "learned.safetensors"))
    with pytest.raises(ValueError, match="holds a LearnedQuest policy, not PrHS"):
        PrHS.load(other)
    with pytest.raises(ValueError, match="holds a LearnedQuest policy, not PrHS"):
        parse_kv(f"prhs:path={other}")
    # a saved PrHS whose wrapped policy's class is not defined here
    path = policy_file(tmp_path, PrHS(small_quest(), time=0.5))
    with safe_open(path, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta["wrapped"] = json.dumps({"class": "NoSuchPolicy", "params": {}})
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="a NoSuchPolicy policy is not registered"):
        PrHS.load(path)


# ------------------------------------------------------------------------------------------ specs
def test_spec_takes_the_wrapped_policy_in_brackets():
    assert parse_kv("prhs:[quest:0.1,rescore=3],time=0.9") == PrHS(Quest(0.1, rescore=3), time=0.9)
    p = parse_kv("prhs:policy=[attn-topk:0.2,sinks=2,window=4],eps=0.1,layer=0+0+1")
    assert p == PrHS(AttentionTopK(0.2, sinks=2, window=4), eps=0.1, layer=(0, 0, 1))
    assert all(type(g) is int for g in p.layer)
    assert parse_kv("prhs:[quest:0.1,page=4],layer=0").layer == (0,)
    assert parse_kv("PrHS:[ssa:0.1,sample=0,page=4],eps=0").policy == SSA(0.1, 0, page=4)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("prhs:[quest:0.1,time=0.9", r"unbalanced '\['"),
        ("prhs:[quest:0.1]],time=0.9", r"unbalanced '\]'"),
        ("prhs:time=0.9", "policy"),
        ("prhs:[prhs:[quest]]", "not a PrHS"),
        ("prhs:[nosuch:0.1]", "unknown KV policy 'nosuch'"),
        ("prhs:[quest],depth=1", "unknown parameter 'depth'"),
        ("prhs:[quest],time=2.0", "time"),
        ("prhs:[ssa:0.1,sample=0.05],eps=0.1", "sample=0"),
    ],
)
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_kv(spec)


# ------------------------------------------------------------------------------- policy contract
@SETTINGS
@given(data=st.data(), eps=st.sampled_from([None, 0.3, 1.0]), near=st.sampled_from([0.0, 0.05, 1.0]))
def test_prhs_selections_meet_the_policy_contract(data, cases, contract, eps, near):
    """The registry contract (visible, unique, forced entries held; the output error bounded by the
    dropped mass) for a fresh selection, a time reuse of the previous step's (the previous query
    ``near`` the step's, up to noise of that scale), and a follower's layer reuse."""
    case = data.draw(cases(page_sizes=(1, 4, 16), num_layers=2, min_extra=1))
    sinks, window = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 8))
    policy = PrHS(Quest(data.draw(st.sampled_from([0.2, 0.5, 8])), page=case.page, sinks=sinks, window=window),
                  eps=eps, time=0.5, layer=(0, 0))  # fmt: skip
    drive = Drive(policy, case)
    drive.prefill(drive.query())
    earlier = case.q + near * drive.query()
    drive.step([earlier, earlier], write=False)  # fresh (the reference query is unset): sets it
    sels = drive.step([case.q, case.q])  # one token later: a time reuse where the query stayed near
    assert sels[0].reuse is not None and sels[1].reuse is not None
    for sel in sels:
        contract.check_entries(sel, case, sinks, window, pages=True)
        contract.check_error_bound(sel, case)


# ------------------------------------------------------------------------------------ calibration
def test_calibrate_measures_every_axis_on_text():
    """`PrHS.calibrate` decodes the texts through the Decoder around the policy and returns a PrHS
    with one depth entry and one group id per layer, a τ from its grid, and the measurements; the
    depth scales average 1 (the policy's budget on average) and groups share their depth entries."""
    model = llama(layers=3)
    texts = [torch.randint(1, 128, (44,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    policy = Quest(0.3, page=4, sinks=1, window=4)
    prhs, report = PrHS.calibrate(Decoder(model, kv=policy), texts, context=36, steps=8, progress=False, min_overlap=0.0, max_increase=1.0)
    assert prhs.policy == policy and len(prhs.depth) == 3 and len(prhs.layer) == 3
    assert prhs.layer == (0, 0, 0)  # any overlap and any increase allowed: one group
    assert len(set(prhs.depth.scale)) == 1 and abs(sum(prhs.depth.scale) / 3 - 1) < 1e-9
    assert prhs.time == 0.5  # any increase allowed: the lowest τ of the grid
    assert {"depth", "layer", "time"} <= set(report) and len(report["depth"]["need"]) == 3
    strict, _ = PrHS.calibrate(Decoder(model, kv=policy), texts, context=36, steps=8, progress=False, min_overlap=1.01,
                               axes=("layer",), eps=0.1)  # fmt: skip
    assert strict.layer == (0, 1, 2) and strict.depth is None and strict.time is None and strict.eps == 0.1
    with pytest.raises(ValueError, match="axes"):
        PrHS.calibrate(Decoder(model, kv=policy), texts, axes=("space",))
    with pytest.raises(ValueError, match="tokens"):
        PrHS.calibrate(Decoder(model, kv=policy), texts, context=40, steps=8)
    with pytest.raises(ValueError, match="budget and window"):
        PrHS.calibrate(Decoder(model, kv=Window(2, 8)), texts, context=36, steps=8)


def test_a_wrapped_learned_policy_keeps_its_tensors_through_save_and_load(tmp_path, monkeypatch):
    """`PrHS.modules` are the wrapped policy's (the Decoder moves them), and `save` / `load` keep
    their tensors, not only the parameters (a policy of one's own is registered to be loaded)."""
    from policyzoo.kv.registry import KV_POLICIES

    monkeypatch.setitem(KV_POLICIES, "learned-quest", LearnedQuest)
    wrapped = PrHS(LearnedQuest(0.3, page=4), time=0.5)
    assert wrapped.modules() == wrapped.policy.modules() and wrapped.modules()
    for t in wrapped.parameters():
        torch.nn.init.normal_(t.data)
    back = PrHS.load(wrapped.save(tmp_path / "learned.safetensors"))
    mine, theirs = wrapped.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
