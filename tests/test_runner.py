"""policyzoo.eval.runner: teacher-forced perplexity, the prefill snapshot and per-batch sampling seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")

from tiny_models import hybrid_model, tiny_model

from policyzoo import Window
from policyzoo.eval.runner import evaluate
from policyzoo.eval.settings import Setting, make_settings
from policyzoo.kv.base import KVState


def _ppl_record(length: int = 80, span: int = 12, seed: int = 0, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (length,), generator=g).tolist()
    return {"task": "ppl", "input_ids": ids, "answer": "", "length": length, "span": span}


def _hf_span_nll(model, ids: list[int], span: int) -> float:
    """Mean NLL of the last ``span`` tokens under the plain HF model (one dense forward)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float()
    return float(torch.nn.functional.cross_entropy(logits[-span - 1 : -1], x[0, -span:]))


def test_teacher_forced_dense_perplexity_equals_the_plain_model():
    model = tiny_model("llama")
    recs = [_ppl_record(seed=0), _ppl_record(seed=1)]
    expected = math.exp(np.mean([_hf_span_nll(model, r["input_ids"], 12) for r in recs]))
    settings = make_settings(["dense", "window:sinks=2,window=8"], ["none"])
    res = evaluate(model, None, settings, recs, progress=False)
    dense, window = res["rows"]
    assert dense["setting"] == "dense" and dense["task"] == "ppl" and dense["n"] == 2
    assert dense["ppl"] == pytest.approx(expected, rel=1e-5)  # decode steps through the Dense policy
    assert dense["dense_ppl"] == pytest.approx(expected, rel=1e-5)  # the reference
    assert dense["kl"] == pytest.approx(0.0, abs=1e-6) and dense["top1"] == 1.0
    assert dense["delta_max"] == pytest.approx(0.0, abs=1e-6) and dense["recall"] == pytest.approx(1.0)
    assert dense["steps"] == 12 and dense["kl_steps"] == 24
    # the same windows under a small window: a different perplexity and a positive dropped mass
    assert window["dense_ppl"] == dense["dense_ppl"]
    assert abs(window["ppl"] / expected - 1) > 1e-4  # random tiny models are near uniform: a small change
    assert window["delta_mean"] > 0.05 and window["kl"] > 0 and window["kv_keep"] < 1


def test_prefill_snapshot_matches_a_policy_own_prefill():
    """Policies that build state in `prefill` get a real prefill; the results match the snapshot path."""
    calls = []

    @dataclass
    class CountingWindow(Window):
        def prefill(self, state: KVState, q, k, v) -> None:
            calls.append(state.layer)

    model = tiny_model("qwen3")
    recs = [_ppl_record(64, 8, seed=s) for s in range(2)]
    plain = Setting("window", Window(sinks=2, window=8), None)
    counting = Setting("counting", CountingWindow(sinks=2, window=8), None)
    res = evaluate(model, None, [plain, counting], recs, progress=False)
    a, b = res["rows"]
    assert calls == [0, 1]  # one prefill per layer (both records in one batch)
    assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-5)
    assert b["delta_mean"] == pytest.approx(a["delta_mean"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
@pytest.mark.parametrize("span", [12, 40], ids=["span-in-ring", "span-past-ring"])
def test_dense_perplexity_beyond_a_sliding_window_equals_the_plain_model(family, span):
    """Models with sliding-window layers evaluate at contexts far beyond the window: the prefill's
    snapshot takes a window layer's keys from its ring (and, where the teacher-forced span reaches
    further back than the ring holds, from a prefill of the snapshot's prefix), and dense decoding
    from it equals the model's own full forward."""
    model = hybrid_model(family, window=8)
    recs = [_ppl_record(90, span, seed=s) for s in range(2)]
    expected = math.exp(np.mean([_hf_span_nll(model, r["input_ids"], span) for r in recs]))
    res = evaluate(model, None, make_settings(["dense", "quest:0.5,page=4"], ["none"]), recs, progress=False)
    dense, quest = res["rows"]
    assert dense["ppl"] == pytest.approx(expected, rel=1e-4) and dense["dense_ppl"] == pytest.approx(expected, rel=1e-4)
    assert dense["kl"] == pytest.approx(0.0, abs=1e-5) and dense["top1"] == 1.0
    assert quest["dense_ppl"] == dense["dense_ppl"]
    if family == "mistral":  # every layer a window layer: the policy runs on none, decoding is dense
        assert quest["ppl"] == pytest.approx(dense["ppl"], rel=1e-5) and math.isnan(quest["delta_mean"])
    else:  # the policy on the full layers
        assert math.isfinite(quest["ppl"]) and quest["kv_keep"] < 1


def test_a_sampling_policy_gives_each_batch_the_same_draws_whatever_ran_before():
    # SSA's random stream restarts per batch: a record's result does not depend on the grid's order.
    model = tiny_model("llama")
    first, second = [_ppl_record(length=90, seed=3)], [_ppl_record(length=70, seed=4)]
    settings = make_settings(["ssa:budget=4,sample=4,proxy=exact,window=4"], ["none"])
    alone = evaluate(model, None, settings, second, progress=False)["rows"][0]
    after = [r for r in evaluate(model, None, settings, first + second, progress=False)["rows"] if r["length"] == 70]
    assert after[0]["ppl"] == alone["ppl"] and after[0]["delta_mean"] == alone["delta_mean"]
