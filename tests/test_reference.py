"""Contract tests of the plain-torch reference kernels (`policyzoo.kernels.reference`): the oracle
every Triton kernel is compared against, so it is checked here against independent computations."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.kernels import reference
from policyzoo.kv import Dense
from policyzoo.selection import Selection

SETTINGS = settings(max_examples=40, deadline=None)


def _naive(case, keep: list[list[set[int]]], shift: dict | None = None):
    """Softmax attention over ``keep[r][hk]`` (visible tokens only), computed token by token in
    float64; ``shift[(r, hk, t)]`` is added to token t's logit."""
    c = case.cache
    out = torch.zeros(case.b, case.h, case.d, dtype=torch.float64)
    lse = torch.full((case.b, case.h), -math.inf, dtype=torch.float64)
    for r in range(case.b):
        vis = set(case.visible_tokens(r))
        for hk in range(case.h_kv):
            toks = sorted(keep[r][hk] & vis)
            if not toks:
                continue
            k = c.keys[0][r, hk, toks].double()
            v = c.values[0][r, hk, toks].double()
            for gi in range(case.g):
                h = hk * case.g + gi
                logit = k @ case.q[r, h].double() * case.scale
                if shift:
                    logit = logit + torch.tensor([shift.get((r, hk, t), 0.0) for t in toks], dtype=torch.float64)
                lse[r, h] = torch.logsumexp(logit, 0)
                out[r, h] = torch.softmax(logit, 0) @ v
    return out, lse


def _token_selection(keep: list[list[list[int]]], k_max: int, pad_value: int = 0) -> Selection:
    b, h_kv = len(keep), len(keep[0])
    idx = torch.full((b, h_kv, k_max), pad_value, dtype=torch.int32)
    cnt = torch.zeros(b, h_kv, dtype=torch.int32)
    for r in range(b):
        for hk in range(h_kv):
            idx[r, hk, : len(keep[r][hk])] = torch.tensor(keep[r][hk], dtype=torch.int32)
            cnt[r, hk] = len(keep[r][hk])
    return Selection(indices=idx, count=cnt)


def _attend(case, sel):
    c = case.cache
    return reference.decode_attention(case.q, c.keys[0], c.values[0], sel, c.start, c.length, case.scale)


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@SETTINGS
@given(data=st.data())
def test_dense_matches_naive_softmax(data, cases):
    case = data.draw(cases())
    out, lse = _attend(case, Dense().select(case.state(), case.q))
    assert out.shape == (case.b, case.h, case.d) and out.dtype == case.q.dtype
    assert lse.shape == (case.b, case.h) and lse.dtype == torch.float32
    want_out, want_lse = _naive(case, [[set(case.visible_tokens(r))] * case.h_kv for r in range(case.b)])
    _close(out, want_out)
    _close(lse, want_lse)
    # dense_probs: the same distribution, zero outside the visible slots
    c = case.cache
    p = reference.dense_probs(case.q, c.keys[0], c.start, c.length, case.scale)
    tv = case.token_valid()[:, None, :].expand_as(p)
    assert bool((p[~tv] == 0).all())
    _close(p.sum(-1), torch.ones(case.b, case.h))
    o_from_p = torch.einsum("bkgn,bknd->bkgd", p.view(case.b, case.h_kv, case.g, -1), c.values[0].float())
    _close(o_from_p.reshape(case.b, case.h, case.d), want_out, tol=1e-4)


@SETTINGS
@given(data=st.data())
def test_random_token_selection_matches_naive(data, cases):
    """Arbitrary subsets, in any order, with garbage padding past count; invisible entries ignored."""
    case = data.draw(cases())
    n = case.cache.capacity
    keep = [
        [data.draw(st.lists(st.integers(0, n - 1), max_size=12, unique=True)) for _ in range(case.h_kv)]
        for _ in range(case.b)
    ]
    k_max = max(1, max(len(x) for row in keep for x in row)) + data.draw(st.integers(0, 3))
    sel = _token_selection(keep, k_max, pad_value=data.draw(st.sampled_from([0, n - 1, n + 100, -3])))
    out, lse = _attend(case, sel)
    want_out, want_lse = _naive(case, [[set(x) for x in row] for row in keep])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _close(out, want_out)
    _close(lse, want_lse)


@SETTINGS
@given(data=st.data())
def test_page_and_token_selections_agree(data, cases):
    case = data.draw(cases())
    c, p = case.cache, case.page
    pidx = torch.zeros(case.b, case.h_kv, c.num_pages, dtype=torch.int32)
    pcnt = torch.zeros(case.b, case.h_kv, dtype=torch.int32)
    toks = []
    for r in range(case.b):
        row = []
        for hk in range(case.h_kv):
            pages = data.draw(st.lists(st.integers(0, c.num_pages - 1), max_size=c.num_pages, unique=True))
            pidx[r, hk, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            pcnt[r, hk] = len(pages)
            # every slot of the pages, visible or not: the kernel must mask the invisible ones
            row.append([pg * p + o for pg in pages for o in range(p)])
        toks.append(row)
    page_sel = Selection(indices=pidx, count=pcnt, block=p)
    tok_sel = _token_selection(toks, max(1, c.capacity))
    o1, l1 = _attend(case, page_sel)
    o2, l2 = _attend(case, tok_sel)
    _close(o1, o2)
    _close(l1, l2)


@SETTINGS
@given(data=st.data())
def test_empty_selection_gives_zero_and_minus_inf(data, cases):
    case = data.draw(cases())
    c = case.cache
    k_max = data.draw(st.integers(1, 4))
    block = data.draw(st.sampled_from([1, case.page]))
    # count 0 (with junk indices), or only entries pointing at invisible slots (left padding/future)
    sel = Selection(
        indices=torch.randint(0, c.capacity // block, (case.b, case.h_kv, k_max), dtype=torch.int32),
        count=torch.zeros(case.b, case.h_kv, dtype=torch.int32),
        log_weight=torch.randn(case.b, case.h_kv, k_max) if data.draw(st.booleans()) else None,
        block=block,
    )
    # entries within count that point only at invisible slots (left padding or the future)
    invisible = []
    for r in range(case.b):
        slots = [t for t in range(c.capacity) if t not in set(case.visible_tokens(r))]
        invisible.append([slots[:3]] * case.h_kv)
    hidden = _token_selection(invisible, 3)
    for s in (sel, hidden):
        out, lse = _attend(case, s)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.equal(out, torch.zeros_like(out))
        assert bool((lse == -math.inf).all())


def test_selection_of_left_padding_only_is_empty(make_case):
    case = make_case(b=1, h_kv=1, g=2, d=8, page=4, prompt=8, steps=0, starts=[5], seed=2)
    sel = _token_selection([[[0, 1, 2, 3, 4]]], 5)
    out, lse = _attend(case, sel)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())


@SETTINGS
@given(data=st.data())
def test_log_weight_shifts_logits(data, cases):
    case = data.draw(cases())
    c = case.cache
    block = data.draw(st.sampled_from([1, case.page]))
    n_entries = c.capacity // block
    k_max = data.draw(st.integers(1, min(n_entries, 8)))
    gen = torch.Generator().manual_seed(case.params["seed"])
    idx = torch.stack([torch.randperm(n_entries, generator=gen)[:k_max] for _ in range(case.b * case.h_kv)])
    idx = idx.view(case.b, case.h_kv, k_max).int()
    cnt = torch.randint(0, k_max + 1, (case.b, case.h_kv), generator=gen).int()
    lw = torch.randn(case.b, case.h_kv, k_max, generator=gen) * 2
    sel = Selection(indices=idx, count=cnt, log_weight=lw, block=block)
    keep, shift = [], {}
    for r in range(case.b):
        row = []
        for hk in range(case.h_kv):
            s = set()
            for e in range(int(cnt[r, hk])):
                for o in range(block):
                    t = int(idx[r, hk, e]) * block + o
                    s.add(t)
                    shift[(r, hk, t)] = float(lw[r, hk, e])
            row.append(s)
        keep.append(row)
    out, lse = _attend(case, sel)
    want_out, want_lse = _naive(case, keep, shift)
    _close(out, want_out)
    _close(lse, want_lse)
    # a constant log-weight leaves the output alone and shifts lse by the constant
    const = Selection(indices=idx, count=cnt, log_weight=torch.full_like(lw, 0.75), block=block)
    plain = Selection(indices=idx, count=cnt, block=block)
    o_c, l_c = _attend(case, const)
    o_p, l_p = _attend(case, plain)
    _close(o_c, o_p)
    _close(l_c, l_p + 0.75)


def test_log_weight_minus_inf_drops_entry(make_case):
    case = make_case(b=1, h_kv=1, g=3, d=16, page=1, prompt=10, steps=0, starts=[0], seed=4)
    lw = torch.tensor([[[0.0, -math.inf, 0.0]]])
    out, lse = _attend(case, Selection(torch.tensor([[[2, 5, 7]]], dtype=torch.int32), torch.tensor([[3]], dtype=torch.int32), lw))
    out2, lse2 = _attend(case, _token_selection([[[2, 7]]], 2))
    _close(out, out2)
    _close(lse, lse2)


@SETTINGS
@given(data=st.data())
def test_quest_bound_is_an_upper_bound(data, cases):
    case = data.draw(cases())
    c = case.cache
    bound = reference.quest_page_bound(case.q, c.page_min[0], c.page_max[0], case.scale)
    assert bound.shape == (case.b, case.h, c.num_pages) and bound.dtype == torch.float32
    qg = case.q.double().view(case.b, case.h_kv, case.g, case.d)
    exact = torch.einsum("bkgd,bknd->bkgn", qg, c.keys[0].double()) * case.scale
    exact = exact.reshape(case.b, case.h, c.capacity)
    # float32 rounding allowance: a few ulps of the sum of |terms|
    mag = torch.maximum(c.page_min[0].abs(), c.page_max[0].abs()).double()  # [B, H_kv, P, D]
    terms = torch.einsum("bkgd,bkpd->bkgp", qg.abs(), mag).reshape(case.b, case.h, c.num_pages) * case.scale
    tol = 1e-5 * terms + 1e-6
    for r in range(case.b):
        for t in case.visible_tokens(r):
            pg = t // case.page
            slack = bound[r, :, pg].double() - exact[r, :, t]
            assert bool((slack >= -tol[r, :, pg]).all()), f"token {t} page {pg}: {slack}"
            if case.page == 1:  # one key per page: the bound is exact
                assert bool((slack.abs() <= tol[r, :, pg]).all()), f"token {t}: bound not exact: {slack}"


def test_quest_bound_by_hand():
    q = torch.tensor([[[1.0, -2.0]]])
    kmin = torch.tensor([[[[-1.0, -1.0], [0.0, 3.0]]]])
    kmax = torch.tensor([[[[2.0, 1.0], [1.0, 4.0]]]])
    # page 0: max(-1, 2) + max(2, -2) = 4; page 1: max(0, 1) + max(-6, -8) = -5; scale 0.5
    assert reference.quest_page_bound(q, kmin, kmax, 0.5).tolist() == [[[2.0, -2.5]]]


def test_visible():
    m = reference.visible(torch.tensor([0, 2]), torch.tensor(4), 6)
    assert m.tolist() == [[True] * 4 + [False] * 2, [False, False, True, True, False, False]]


def test_sparse_linear_is_linear_of_kept_inputs():
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(3, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(5, generator=gen)
    keep = torch.rand(3, 8, generator=gen) > 0.5
    want = torch.stack([w[:, keep[i]] @ x[i, keep[i]] + bias for i in range(3)])
    torch.testing.assert_close(reference.sparse_linear(x, w, bias, keep), want)
    torch.testing.assert_close(reference.sparse_linear(x, w, None, torch.ones_like(keep)), x @ w.T)


# ------------------------------------------------------------------------------------ key sketch
@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 40), page=st.integers(1, 16), pages=st.integers(1, 4), g=st.integers(1, 4),
    spread=st.sampled_from([0.0, 1e-3, 1.0, 50.0]), sharp=st.sampled_from([0.1, 1.0, 10.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1),
)
def test_the_sketch_bound_is_above_every_key_and_within_its_radius(d, page, pages, g, spread, sharp, dtype, seed):
    """Decoded keys sit within the radius of the keys they code, and the token bound is at least the
    exact logit of every key: any head dim (odd ones pack a spare nibble), page, spread and dtype."""
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(1, 2, pages, page, d, generator=gen) * spread + torch.randn(1, 2, pages, 1, d, generator=gen)).to(dtype)
    lo, hi = keys.amin(3), keys.amax(3)
    codes = reference.sketch_encode(keys, lo, hi)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == -(-d // 2)
    low, step, radius = reference.sketch_grid(lo, hi)
    decoded = low.unsqueeze(3) + reference.sketch_decode_codes(codes, d) * step.unsqueeze(3)
    assert bool(((decoded - keys.float()).abs() <= radius.unsqueeze(3)).all())
    q = (torch.randn(1, 2 * g, d, generator=gen) * sharp).to(dtype)
    scale = d**-0.5
    bound = reference.sketch_token_bound(q, codes.flatten(2, 3), lo, hi, scale)  # [1, H, N]
    exact = torch.einsum("kgd,kpnd->kgpn", q.float().view(2, g, d), keys[0].float()).reshape(1, 2 * g, -1) * scale
    assert bool((bound >= exact - 1e-5 * (1 + exact.abs())).all())
    assert bool((bound <= exact + scale * 2 * (q.float().abs().view(2, g, 1, d) * radius[0, :, None]).sum(-1).repeat_interleave(page, -1).reshape(1, 2 * g, -1) + 1e-4).all())


def test_the_sketch_page_bound_masks_invisible_slots_and_folds_groups():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 1, 3, 4, 6, generator=gen)
    start, length = torch.tensor([0, 5]), torch.tensor(10)
    seen = reference.visible(start, length, 12).view(2, 1, 3, 4, 1)
    lo = keys.masked_fill(~seen, math.inf).amin(3).nan_to_num(0.0, posinf=0.0)
    hi = keys.masked_fill(~seen, -math.inf).amax(3).nan_to_num(0.0, neginf=0.0)
    codes = reference.sketch_encode(keys, lo, hi).flatten(2, 3)
    q = torch.randn(2, 2, 6, generator=gen)
    per_head = reference.sketch_page_bound(q, codes, lo, hi, start, length, 0.5)
    tokens = reference.sketch_token_bound(q, codes, lo, hi, 0.5).view(2, 2, 3, 4)
    want = tokens.masked_fill(~seen.view(2, 1, 3, 4), -math.inf).amax(-1)
    assert torch.equal(per_head, want)
    assert bool(per_head[1, :, 0].isneginf().all()) and bool(per_head[0].isfinite().all())  # row 1's page 0 is padding
    assert torch.equal(reference.sketch_page_bound(q, codes, lo, hi, start, length, 0.5, "max"), want.amax(1, keepdim=True))
