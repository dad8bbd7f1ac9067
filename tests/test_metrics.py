"""Contract tests of the audit metrics (`policyzoo.eval.metrics`)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from policyzoo.eval.metrics import dropped_mass, group_mean, logits_kl, relative_output_error, top1_agreement, topk_mass_recall
from policyzoo.eval.runner import evaluate
from policyzoo.eval.settings import Setting
from policyzoo.kernels import reference
from policyzoo.kv import AttentionTopK, Dense, Quest, Window
from policyzoo.selection import Selection

SETTINGS = settings(max_examples=40, deadline=None)


def _tok_sel(indices, count, block=1):
    return Selection(torch.tensor(indices, dtype=torch.int32), torch.tensor(count, dtype=torch.int32), block=block)


def test_dropped_mass_by_hand():
    # B=1, H=2 query heads sharing one KV head, N=5 slots, slot 4 not visible
    p = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]]])
    tv = torch.tensor([[True, True, True, True, False]])
    sel = _tok_sel([[[1, 3, 0]]], [[2]])  # keeps {1, 3}; entry 0 is padding
    torch.testing.assert_close(dropped_mass(p, sel, tv), torch.tensor([[1 - 0.6, 1 - 0.5]]))
    # pages of 2: page 1 = slots {2, 3}
    sel = _tok_sel([[[1]]], [[1]], block=2)
    torch.testing.assert_close(dropped_mass(p, sel, tv), torch.tensor([[0.3, 0.5]]))
    # an invisible slot in the selection keeps nothing (page 2 = slots {4, 5}, 5 out of range)
    sel = _tok_sel([[[2, 0]]], [[2]], block=2)
    torch.testing.assert_close(dropped_mass(p, sel, tv), torch.tensor([[0.7, 0.5]]))
    # empty selection: everything dropped
    sel = _tok_sel([[[0]]], [[0]])
    torch.testing.assert_close(dropped_mass(p, sel, tv), torch.tensor([[1.0, 1.0]]))


def test_dropped_mass_per_kv_head():
    # H=4, H_kv=2: heads 0,1 use KV head 0's selection, heads 2,3 KV head 1's
    p = torch.full((1, 4, 4), 0.25)
    sel = _tok_sel([[[0, 1, 2], [3, 0, 0]]], [[3, 1]])
    out = dropped_mass(p, sel, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.25, 0.75, 0.75]]))


@SETTINGS
@given(data=st.data())
def test_dropped_mass_full_and_partial(data, cases):
    case = data.draw(cases())
    c = case.cache
    p = reference.dense_probs(case.q, c.keys[0], c.start, c.length, case.scale)
    tv = c.token_valid()
    full = [
        Dense().select(case.state(), case.q),
        AttentionTopK(1.0).select(case.state(), case.q),
        Quest(1.0, page=case.page).select(case.state(), case.q),
        Window(sinks=0, window=c.capacity).select(case.state(), case.q),
    ]
    for sel in full:
        d = dropped_mass(p, sel, tv)
        assert d.shape == (case.b, case.h) and d.dtype == torch.float32
        torch.testing.assert_close(d, torch.zeros_like(d), atol=1e-5, rtol=0)
    # any selection: delta = 1 - kept probability, computed independently
    sel = Window(sinks=data.draw(st.integers(0, 4)), window=data.draw(st.integers(1, 10))).select(case.state(), case.q)
    d = dropped_mass(p, sel, tv)
    for r in range(case.b):
        for hk in range(case.h_kv):
            kept = sel.indices[r, hk, : int(sel.count[r, hk])].long()
            for gi in range(case.g):
                h = hk * case.g + gi
                want = 1.0 - float(p[r, h, kept].double().sum())
                assert abs(float(d[r, h]) - max(want, 0.0)) < 1e-5
    assert bool((d >= 0).all()) and bool((d <= 1).all())


def test_relative_output_error():
    o = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    oh = torch.tensor([[3.0, 5.0], [0.0, 0.0]])
    err = relative_output_error(o, oh)
    torch.testing.assert_close(err, torch.tensor([0.2, 0.0]))
    assert not torch.isnan(err).any()  # a zero reference does not divide by zero
    torch.testing.assert_close(relative_output_error(o, o), torch.zeros(2))
    torch.testing.assert_close(relative_output_error(o.half(), oh.half()), torch.tensor([0.2, 0.0]))


def test_logits_kl_by_hand():
    a = torch.tensor([0.0, math.log(3.0)])  # p = (1/4, 3/4)
    b = torch.tensor([0.0, 0.0])  # q = (1/2, 1/2)
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    torch.testing.assert_close(logits_kl(a, b), torch.tensor(want))
    torch.testing.assert_close(logits_kl(a, a), torch.tensor(0.0))


@SETTINGS
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(2, 50),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.1, 1.0, 10.0, 50.0]),
    shift=st.floats(-100, 100),
)
def test_logits_kl_properties(rows, vocab, seed, spread, shift):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, vocab, generator=gen) * spread
    b = torch.randn(rows, vocab, generator=gen) * spread
    kl = logits_kl(a, b)
    assert kl.shape == (rows,) and bool(torch.isfinite(kl).all())
    assert bool((kl >= -1e-5).all())
    torch.testing.assert_close(logits_kl(a, a), torch.zeros(rows), atol=1e-5, rtol=0)
    # invariant to a constant shift of either side's logits
    torch.testing.assert_close(logits_kl(a + shift, b), kl, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(logits_kl(a.half(), a.half()), torch.zeros(rows), atol=1e-5, rtol=0)


def test_top1_agreement():
    a = torch.tensor([[0.1, 0.9, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    b = torch.tensor([[0.0, 3.0, 1.0], [0.0, 1.0, 0.5], [1.0, 0.0, 5.0]])
    agree = top1_agreement(a, b)
    assert agree.dtype == torch.bool and agree.tolist() == [True, False, True]
    assert bool(top1_agreement(a, a).all())


def test_group_mean():
    x = torch.tensor([[1.0, 3.0, 5.0, 7.0, 9.0, 11.0]])
    torch.testing.assert_close(group_mean(x, 3), torch.tensor([[2.0, 6.0, 10.0]]))
    torch.testing.assert_close(group_mean(x, 1), torch.tensor([[6.0]]))
    torch.testing.assert_close(group_mean(x, 6), x)


def _ppl_record(length: int = 80, span: int = 12, seed: int = 0, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (length,), generator=g).tolist()
    return {"task": "ppl", "input_ids": ids, "answer": "", "length": length, "span": span}


def test_topk_mass_recall_by_hand():
    p = torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]]])  # [B=1, H=2, N=4], one KV head
    valid = torch.ones(1, 4, dtype=torch.bool)
    sel = Selection(indices=torch.tensor([[[1, 2, 0]]], dtype=torch.int32), count=torch.tensor([[2]], dtype=torch.int32))
    recall = topk_mass_recall(p, sel, valid)
    # head 0 kept 0.3 + 0.2 of the best two (0.5 + 0.3); head 1 kept 0.2 + 0.3 of 0.4 + 0.3
    assert recall[0].tolist() == pytest.approx([0.5 / 0.8, 0.5 / 0.7])
    best = Selection(indices=torch.tensor([[[0, 1, 3]]], dtype=torch.int32), count=torch.tensor([[2]], dtype=torch.int32))
    assert topk_mass_recall(p[:, :1], best, valid).item() == pytest.approx(1.0)
    empty = Selection(indices=torch.zeros(1, 1, 3, dtype=torch.int32), count=torch.zeros(1, 1, dtype=torch.int32))
    assert topk_mass_recall(p, empty, valid)[0].tolist() == [1.0, 1.0]  # nothing kept, nothing to recall
    pages = Selection(indices=torch.tensor([[[1]]], dtype=torch.int32), count=torch.tensor([[1]], dtype=torch.int32), block=2)
    assert topk_mass_recall(p[:, :1], pages, valid).item() == pytest.approx(0.2 / 0.8)  # tokens 2, 3


def test_recall_is_one_for_exact_topk_without_forced_tokens():
    model = tiny_model("llama", heads=2, kv_heads=2)  # no GQA: the exact top-k is the best selection
    settings = [Setting("topk", AttentionTopK(16, sinks=0, window=0), None)]
    res = evaluate(model, None, settings, [_ppl_record(64, 6)], progress=False)
    row = res["rows"][0]
    # The chooser ranks at bf16 precision, so near-ties may swap: a hair below 1.
    assert row["recall"] == pytest.approx(1.0, abs=1e-4) and row["recall_p5"] == pytest.approx(1.0, abs=1e-4)
    assert row["delta_mean"] > 0
