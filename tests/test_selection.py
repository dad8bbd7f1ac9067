"""Contract tests of `policyzoo.selection.Selection`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.selection import Selection

SETTINGS = settings(max_examples=60, deadline=None)


def _sel(indices, count, block=1, log_weight=None):
    return Selection(
        indices=torch.tensor(indices, dtype=torch.int32),
        count=torch.tensor(count, dtype=torch.int32),
        log_weight=log_weight,
        block=block,
    )


def test_k_max_and_entry_valid():
    sel = _sel([[[5, 2, 9], [1, 0, 0]]], [[2, 0]])
    assert sel.k_max == 3
    assert sel.entry_valid().tolist() == [[[True, True, False], [False, False, False]]]


def test_token_positions_tokens_and_pages():
    sel = _sel([[[3, 1]]], [[1]])
    pos, valid = sel.token_positions()
    assert pos.tolist() == [[[3, 1]]] and valid.tolist() == [[[True, False]]]
    assert pos.dtype == torch.int64
    sel = _sel([[[2, 0]]], [[1]], block=4)
    pos, valid = sel.token_positions()
    assert pos.tolist() == [[[8, 9, 10, 11, 0, 1, 2, 3]]]
    assert valid.tolist() == [[[True] * 4 + [False] * 4]]


def test_token_mask_and_kept_tokens_by_hand():
    # B=2, H_kv=1, pages of 4, n=12 slots; row 0 keeps pages {0, 2}, row 1 keeps page {1}
    sel = _sel([[[0, 2, 1]], [[1, 0, 2]]], [[2], [1]], block=4)
    mask = sel.token_mask(12)
    assert mask.shape == (2, 1, 12) and mask.dtype == torch.bool
    assert torch.nonzero(mask[0, 0]).flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert torch.nonzero(mask[1, 0]).flatten().tolist() == [4, 5, 6, 7]
    # row 0 visible 2..9, row 1 visible 0..9
    tv = torch.zeros(2, 12, dtype=torch.bool)
    tv[0, 2:10] = True
    tv[1, :10] = True
    assert sel.kept_tokens(tv).tolist() == [[4.0], [4.0]]  # {2, 3, 8, 9} and {4..7}


def test_empty_selection():
    sel = _sel([[[0, 0]]], [[0]], block=4)
    assert not sel.token_mask(8).any()
    assert sel.kept_tokens(torch.ones(1, 8, dtype=torch.bool)).tolist() == [[0.0]]


@SETTINGS
@given(
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    block=st.sampled_from([1, 4, 16]),
    pages=st.integers(1, 6),
    k_max=st.integers(1, 6),
    data=st.data(),
)
def test_token_mask_matches_sets(b, h_kv, block, pages, k_max, data):
    n = pages * block
    idx = torch.zeros(b, h_kv, k_max, dtype=torch.int32)
    cnt = torch.zeros(b, h_kv, dtype=torch.int32)
    want = {}
    for r in range(b):
        for hk in range(h_kv):
            c = data.draw(st.integers(0, min(k_max, pages)))
            chosen = data.draw(st.lists(st.integers(0, pages - 1), min_size=c, max_size=c, unique=True))
            junk = data.draw(st.lists(st.integers(0, pages - 1), min_size=k_max - c, max_size=k_max - c))
            idx[r, hk] = torch.tensor(chosen + junk, dtype=torch.int32)
            cnt[r, hk] = c
            want[r, hk] = {p * block + o for p in chosen for o in range(block)}
    tv = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))).view(b, n)
    sel = Selection(indices=idx, count=cnt, block=block)
    mask = sel.token_mask(n)
    kept = sel.kept_tokens(tv)
    assert kept.shape == (b, h_kv) and kept.dtype == torch.float32
    for r in range(b):
        for hk in range(h_kv):
            assert set(torch.nonzero(mask[r, hk]).flatten().tolist()) == want[r, hk]
            assert int(kept[r, hk]) == sum(1 for t in want[r, hk] if tv[r, t])


@pytest.mark.parametrize("block", [1, 4])
def test_token_mask_tolerates_padding_entries_past_count(block):
    # padding entries may hold anything (here ids past the cache): they are never read
    sel = _sel([[[1, 1000, -5]]], [[1]], block=block)
    mask = sel.token_mask(2 * block)
    assert torch.nonzero(mask[0, 0]).flatten().tolist() == list(range(block, 2 * block))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), parts=st.sampled_from([1, 2, 4]), page=st.sampled_from([1, 4]), k_max=st.integers(1, 5))
def test_split_covers_the_same_tokens_in_smaller_entries(data, parts, page, k_max):
    """`Selection.split`: the same token mask and per-token log weights, in entries of ``block``."""
    block = parts * page
    n = 8 * block
    idx = torch.tensor([data.draw(st.permutations(range(8)))[:k_max] for _ in range(2)], dtype=torch.int32).view(1, 2, k_max)
    count = torch.tensor([[data.draw(st.integers(0, k_max)) for _ in range(2)]], dtype=torch.int32)
    lw = torch.randn(1, 2, k_max) if data.draw(st.booleans()) else None
    sel = Selection(idx, count, lw, block)
    small = sel.split(page)
    assert small.block == page and small.k_max == k_max * parts and torch.equal(small.count, count * parts)
    assert torch.equal(small.token_mask(n), sel.token_mask(n))
    if lw is not None:  # each token keeps its entry's weight
        big_w = lw.repeat_interleave(block, -1)
        small_w = small.log_weight.repeat_interleave(page, -1)
        assert torch.equal(big_w, small_w)
    assert sel.split(block) is sel
    with pytest.raises(ValueError, match="split"):
        sel.split(block + 1) if block > 1 else sel.split(2)
