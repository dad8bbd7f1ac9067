"""Contract tests of `policyzoo.cache.PagedKVCache`: visibility, page counts, write slots and the
incremental page summaries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch import Tensor

from policyzoo.cache import SUMMARIES, PagedKVCache, page_summaries
from policyzoo.kernels import reference

SETTINGS = settings(max_examples=50, deadline=None)


def _recomputed(case, layer: int) -> dict[str, torch.Tensor]:
    """Summaries recomputed from scratch with `page_summaries` over the full page view."""
    c = case.cache
    b, h, p, d = c.batch, c.num_kv_heads, c.page_size, c.head_dim
    keys = c.keys[layer].view(b, h, c.num_pages, p, d)
    mask = case.token_valid().view(b, 1, c.num_pages, p, 1).expand_as(keys)
    return dict(zip(SUMMARIES, page_summaries(keys, mask)))


def _check_summaries(case, layer: int, all_pages: bool) -> None:
    c = case.cache
    ref = _recomputed(case, layer)
    # Pages nobody may see: after a reuse they may keep a previous sequence's summaries (they are
    # masked by page_counts everywhere); a fresh cache has zeros there, as a recomputation does.
    live = (c.page_counts() > 0)[:, None, :, None].expand(-1, c.num_kv_heads, -1, c.head_dim)
    for name in SUMMARIES:
        got = getattr(c, name)[layer]
        # Every summary is kept in the cache's dtype. Min and max are key values, so exact there; mean
        # and std are rounded from fp32 sums (a different order of summation may round them 1 ulp apart).
        exact = name in ("page_min", "page_max")
        assert got.dtype == c.dtype
        assert got.shape == (c.batch, c.num_kv_heads, c.num_pages, c.head_dim)
        want = ref[name].to(got.dtype)
        if exact:
            assert torch.equal(want.float(), ref[name]), name  # the recomputed extremes are representable
        ulp = torch.finfo(c.dtype).eps
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=max(1e-5, ulp), atol=max(1e-5, ulp))
        if all_pages:
            torch.testing.assert_close(got, want, msg=name, **tol)
        else:
            torch.testing.assert_close(got[live], want[live], msg=name, **tol)


@SETTINGS
@given(data=st.data())
def test_incremental_summaries_equal_recomputation(data, cases):
    case = data.draw(cases(num_layers=2, max_steps=10, dtypes=(torch.float32, torch.bfloat16, torch.float16)))
    for layer in range(2):
        _check_summaries(case, layer, all_pages=not case.params["reuse"])


@SETTINGS
@given(data=st.data())
def test_summaries_after_every_append(data, cases):
    """The Decoder's loop: ``length += 1`` then one write per layer; summaries exact at every step."""
    case = data.draw(cases(num_layers=2, max_steps=0, max_prompt=30, min_extra=1))
    c = case.cache
    gen = torch.Generator().manual_seed(case.params["seed"] + 1)
    n_more = data.draw(st.integers(1, min(12, c.capacity - case.length)))
    for _ in range(n_more):
        c.length += 1
        for layer in range(2):
            k = torch.randn(c.batch, c.num_kv_heads, 1, c.head_dim, generator=gen) * 3
            c.write(layer, k, -k)
        for layer in range(2):
            _check_summaries(case, layer, all_pages=not case.params["reuse"])


@SETTINGS
@given(data=st.data())
def test_summaries_match_visible_keys(data, cases):
    """Independent check: min/max/mean/std (population) of the visible keys of each page."""
    case = data.draw(cases(max_steps=8))
    c = case.cache
    for r in range(case.b):
        vis = case.visible_tokens(r)
        for pg in range(c.num_pages):
            toks = [t for t in vis if t // c.page_size == pg]
            if not toks:
                continue
            k = case.real_k[r][:, toks].double()  # [H_kv, n, D]
            torch.testing.assert_close(c.page_min[0][r, :, pg].double(), k.amin(1), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(c.page_max[0][r, :, pg].double(), k.amax(1), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(c.page_mean[0][r, :, pg].double(), k.mean(1), rtol=1e-5, atol=1e-5)
            std = k.std(1, correction=0)
            torch.testing.assert_close(c.page_std[0][r, :, pg].double(), std, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(data=st.data())
def test_visibility_and_page_counts(data, cases):
    case = data.draw(cases())
    c = case.cache
    tv = c.token_valid()
    assert tv.dtype == torch.bool and tv.shape == (c.batch, c.capacity)
    assert torch.equal(tv, case.token_valid())
    counts = c.page_counts()
    assert counts.shape == (c.batch, c.num_pages)
    assert bool((counts >= 0).all()) and bool((counts <= c.page_size).all())
    for r in range(case.b):
        assert int(counts[r].sum()) == case.n_valid(r)
        for pg in range(c.num_pages):
            n = sum(1 for t in case.visible_tokens(r) if t // c.page_size == pg)
            assert int(counts[r, pg]) == n
    # page_counts agrees with token_valid
    assert torch.equal(counts, tv.view(c.batch, c.num_pages, c.page_size).sum(-1))


@SETTINGS
@given(data=st.data())
def test_write_lands_at_length_minus_one(data, cases):
    case = data.draw(cases(num_layers=2, max_steps=3, min_extra=1))
    c = case.cache
    before_k = [k.clone() for k in c.keys]
    before_v = [v.clone() for v in c.values]
    c.length += 1
    slot = int(c.length) - 1
    k = torch.randn(c.batch, c.num_kv_heads, 1, c.head_dim)
    v = torch.randn(c.batch, c.num_kv_heads, 1, c.head_dim)
    c.write(1, k, v)
    assert int(c.length) == slot + 1, "write must not advance length"
    assert isinstance(c.length, torch.Tensor) and c.length.dim() == 0
    assert torch.equal(c.keys[1][:, :, slot], k[:, :, 0])
    assert torch.equal(c.values[1][:, :, slot], v[:, :, 0])
    others = torch.ones(c.capacity, dtype=torch.bool)
    others[slot] = False
    assert torch.equal(c.keys[1][:, :, others], before_k[1][:, :, others])
    assert torch.equal(c.values[1][:, :, others], before_v[1][:, :, others])
    # the other layer is untouched
    assert torch.equal(c.keys[0], before_k[0]) and torch.equal(c.values[0], before_v[0])


def test_prefill_writes_slots_and_sets_visibility():
    c = PagedKVCache(1, 2, 1, 4, capacity=10, page_size=4)
    assert c.capacity == 12 and c.num_pages == 3
    k = torch.arange(2 * 7 * 4, dtype=torch.float32).view(2, 1, 7, 4)
    c.reset(torch.tensor([0, 3]), 7)
    c.write_prefill(0, k, -k)
    assert torch.equal(c.keys[0][:, :, :7], k) and torch.equal(c.values[0][:, :, :7], -k)
    assert c.page_counts().tolist() == [[4, 3, 0], [1, 3, 0]]
    # row 1's first page holds one visible token (slot 3): its summaries are that key
    torch.testing.assert_close(c.page_min[0][1, 0, 0], k[1, 0, 3])
    torch.testing.assert_close(c.page_max[0][1, 0, 0], k[1, 0, 3])
    torch.testing.assert_close(c.page_mean[0][1, 0, 0], k[1, 0, 3])
    torch.testing.assert_close(c.page_std[0][1, 0, 0], torch.zeros(4))
    # the empty future page has zero summaries
    for name in SUMMARIES:
        assert torch.equal(getattr(c, name)[0][:, :, 2], torch.zeros(2, 1, 4))


def test_page_summaries_empty_page_is_zero_not_inf():
    k = torch.randn(2, 3, 5)
    mask = torch.zeros(2, 3, 5, dtype=torch.bool)
    mask[0, :2] = True
    kmin, kmax, mean, std = page_summaries(k, mask)
    for t in (kmin, kmax, mean, std):
        assert torch.isfinite(t).all()
        assert torch.equal(t[1], torch.zeros(5))
    torch.testing.assert_close(kmin[0], k[0, :2].amin(0))
    torch.testing.assert_close(kmax[0], k[0, :2].amax(0))
    torch.testing.assert_close(mean[0], k[0, :2].mean(0))
    torch.testing.assert_close(std[0], k[0, :2].std(0, correction=0))


def test_reset_rejects_overlong_prompt():
    c = PagedKVCache(1, 1, 1, 8, capacity=8, page_size=4)
    with pytest.raises(ValueError):
        c.reset(torch.zeros(1, dtype=torch.long), 9)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None])
def test_bad_page_size(bad):
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(1, 1, 1, 8, capacity=16, page_size=bad)


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_capacity(bad):
    with pytest.raises(ValueError, match="capacity"):
        PagedKVCache(1, 1, 1, 8, capacity=bad, page_size=4)


@pytest.mark.parametrize("arg", ["num_layers", "batch", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1])
def test_bad_shape_args(arg, bad):
    kwargs = dict(num_layers=1, batch=1, num_kv_heads=1, head_dim=8, capacity=16, page_size=4)
    kwargs[arg] = bad
    with pytest.raises(ValueError, match=arg):
        PagedKVCache(**kwargs)


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("capacity", [1, 5, 16, 17])
def test_capacity_rounds_up_to_pages(page, capacity):
    c = PagedKVCache(1, 1, 1, 8, capacity=capacity, page_size=page)
    assert c.capacity % page == 0 and capacity <= c.capacity < capacity + page
    assert c.num_pages * page == c.capacity
    assert c.keys[0].shape == (1, 1, c.capacity, 8)
    assert c.page_min[0].shape == (1, 1, c.num_pages, 8)
    assert c.length.dim() == 0 and c.length.dtype == torch.long


@pytest.mark.parametrize(
    "asked, kept",
    [((), ()), (("page_min",), ("page_min", "page_max")), (("page_std",), ("page_mean", "page_std")),
     (("page_max", "page_mean"), SUMMARIES), (SUMMARIES, SUMMARIES)],
)
def test_cache_keeps_only_the_summaries_asked_for_in_pairs(asked, kept):
    """Min and max come as a pair, and so do mean and std (one kernel pass computes both halves); a
    summary not kept is not allocated, and reading it says why instead of returning stale zeros."""
    c = PagedKVCache(2, 1, 2, 8, capacity=16, page_size=4, summaries=asked)
    assert c.summaries == kept and c.keeps(*kept)
    for name in SUMMARIES:
        if name in kept:
            assert getattr(c, name)[1].shape == (1, 2, 4, 8)
        else:
            assert not c.keeps(name)
            with pytest.raises(RuntimeError, match=f"keeps no {name}.*KVSelector.summaries"):
                getattr(c, name)[0]
    assert len(c.tensors()) == 2 * (2 + len(kept)) + 2  # per layer: keys, values, kept summaries; length, start


def test_cache_without_summaries_still_writes_and_prefills():
    c = PagedKVCache(1, 1, 1, 4, capacity=8, page_size=4, summaries=())
    k = torch.randn(1, 1, 5, 4)
    c.reset(torch.tensor([0]), 5)
    c.write_prefill(0, k, -k)
    c.length += 1
    new = torch.randn(1, 1, 1, 4)
    c.write(0, new, -new)
    assert torch.equal(c.keys[0][:, :, :5], k) and torch.equal(c.keys[0][:, :, 5], new[:, :, 0])
    assert torch.equal(c.values[0][:, :, 5], -new[:, :, 0])


@SETTINGS
@given(data=st.data())
def test_kept_summaries_equal_recomputation_when_others_are_dropped(data, cases):
    """Keeping only one pair changes nothing about that pair's values."""
    case = data.draw(cases(num_layers=1, max_steps=6))
    c = case.cache
    pair = data.draw(st.sampled_from([("page_min", "page_max"), ("page_mean", "page_std")]))
    lone = PagedKVCache(1, c.batch, c.num_kv_heads, c.head_dim, c.capacity, page_size=c.page_size,
                        dtype=c.dtype, summaries=pair)
    lone.keys[0].copy_(c.keys[0])
    lone.reset(c.start, int(c.length))
    lone.summarise(0, slice(0, lone.num_pages))
    ref = _recomputed(case, 0)
    for name in pair:
        torch.testing.assert_close(getattr(lone, name)[0], ref[name].to(getattr(lone, name)[0].dtype), rtol=1e-5, atol=1e-5)


def test_unknown_summary_is_rejected():
    with pytest.raises(ValueError, match="summaries must be a subset"):
        PagedKVCache(1, 1, 1, 8, capacity=16, page_size=4, summaries=("page_median",))


# ------------------------------------------------------------------------------------ key sketch
def _visible_codes(c: PagedKVCache, layer: int) -> Tensor:
    """``uint8[B, H_kv, N, ceil(D/2)]`` with the codes of slots not visible zeroed (they are masked)."""
    return c.key_sketch[layer] * c.token_valid()[:, None, :, None]


@SETTINGS
@given(data=st.data())
def test_the_key_sketch_after_every_append_equals_recoding_the_cache(data, cases):
    """A write recodes its page (its grid may have moved): after any prefill and appends the sketch of
    every visible key equals `reference.sketch_encode` of the keys on the current min/max."""
    case = data.draw(cases(num_layers=2, max_steps=10, sketch=(True,), dtypes=(torch.float32, torch.bfloat16)))
    c = case.cache
    for layer in range(2):
        b, h, n, d = c.keys[layer].shape
        pages = c.keys[layer].view(b, h, c.num_pages, c.page_size, d)
        want = reference.sketch_encode(pages, c.page_min[layer], c.page_max[layer]).view(b, h, n, -1)
        want = want * c.token_valid()[:, None, :, None]
        assert torch.equal(_visible_codes(c, layer), want)


def test_the_key_sketch_brings_its_grid_and_is_refused_when_not_kept():
    c = PagedKVCache(2, 1, 2, 9, capacity=16, page_size=4, summaries=("key_sketch",))
    assert c.summaries == ("page_min", "page_max", "key_sketch") and c.keeps("key_sketch")
    assert c.key_sketch[1].shape == (1, 2, 16, 5) and c.key_sketch[1].dtype == torch.uint8  # odd D: 9 channels in 5 bytes
    assert len(c.tensors()) == 2 * 5 + 2
    plain = PagedKVCache(1, 1, 1, 8, capacity=16, page_size=4)
    with pytest.raises(RuntimeError, match="keeps no key_sketch"):
        plain.key_sketch[0]
