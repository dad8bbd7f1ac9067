"""Regional compilation (`policyzoo.regional`): one compiled decoder layer serves every layer, the
tokens are those of eager decoding, and what cannot be compiled by layer compiles the whole step."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from tiny_models import LearnedQuest, padded_batch, tiny_model
from torch._dynamo.utils import counters

from policyzoo import SSA, AttentionTopK, Certified, Decoder, Dense, EntmaxKV, Quest, Threshold, TopK, Window
from policyzoo.regional import layer_invariant

POLICIES = {
    "dense": (lambda: None, lambda: None),
    "window": (lambda: Window(2, 8), lambda: None),
    "attn-topk": (lambda: AttentionTopK(0.3, window=4), lambda: None),
    "quest": (lambda: Quest(0.3, page=4), lambda: None),
    "ssa": (lambda: SSA(0.2, 0.2, page=4, window=4), lambda: None),
    "ssa-exact": (lambda: SSA(0.2, 0.2, proxy="exact", window=4), lambda: None),
    "entmax-kv": (lambda: EntmaxKV(0.5, page=4), lambda: None),
    "entmax-kv-entmax": (lambda: EntmaxKV(0.5, page=4, attention="entmax"), lambda: None),
    "certified-quest": (lambda: Certified(Quest(0.2, page=4), eps=0.1), lambda: None),
    "topk": (lambda: None, lambda: TopK(0.5)),
    "quest-rescore": (lambda: Quest(0.3, page=4, rescore=2), lambda: None),
}
INDUCTOR = ("quest", "ssa", "certified-quest", "topk", "quest-rescore")  # the rest on aot_eager: the views' logic, faster


def _pair(name: str, layers: int = 3):
    kv, proj = POLICIES[name]
    model = tiny_model("llama", layers=layers)
    return Decoder(copy.deepcopy(model), kv=kv(), proj=proj()), Decoder(model, kv=kv(), proj=proj())


def _run(dec: Decoder, ids, mask, new: int = 8):
    if isinstance(dec.kv, SSA):
        dec.kv.reseed(0)
    return dec.generate(ids, new, attention_mask=mask)


@pytest.mark.parametrize("name", list(POLICIES))
def test_one_compiled_layer_serves_every_layer_with_the_eager_tokens(name):
    eager, dec = _pair(name)
    torch._dynamo.reset()
    counters.clear()
    dec.compile(backend="inductor" if name in INDUCTOR else "aot_eager")
    assert dec.session.compiled_steps.regional
    ids, mask = padded_batch(2, 23)
    want = _run(eager, ids, mask)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _run(dec, ids, mask)
        again = _run(dec, ids, mask)  # the same cache: the same compiled layer
    assert torch.equal(got, want) and torch.equal(again, want)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for 3 layers and 7 steps
    # Outside the compiled steps the model is the plain eager one again.
    for block in dec.model.model.layers:
        assert block._compiled_call_impl is None


@pytest.mark.parametrize("make", [Dense, lambda: Window(sinks=2, window=8)], ids=["dense", "window"])
def test_a_selection_the_same_in_every_layer_is_made_once_a_step_outside_the_compiled_layer(make):
    """The compiled layer reads the step's shared selection as an input: the policy's select runs
    once a decode step, before the layers, and never inside the compiled layer (where it would run
    in every layer of every replayed step, and only at tracing in Python)."""
    policy = make()
    ids, mask = padded_batch(2, 21)
    eager_tokens = Decoder(tiny_model("llama", layers=3), kv=make()).generate(ids, 6, attention_mask=mask)
    dec = Decoder(tiny_model("llama", layers=3), kv=policy)
    torch._dynamo.reset()
    dec.compile(backend="aot_eager")
    assert dec.session.compiled_steps.regional
    with mock.patch.object(type(policy), "select", autospec=True, side_effect=type(policy).select) as select:
        with torch._dynamo.config.patch(error_on_recompile=True):
            tokens = dec.generate(ids, 6, attention_mask=mask)
    assert select.call_count == 5  # 5 decode steps after the prefill's token
    assert torch.equal(tokens, eager_tokens)


def test_the_shared_selection_follows_a_dynamic_capacity_without_a_recompile():
    """With a dynamic capacity the shared selection's width (the cache's pages) is a symbol of the
    compiled layer, as the cache's own sizes are: a longer prompt reuses the compiled layer."""
    model = tiny_model("llama", layers=2)
    eager = Decoder(copy.deepcopy(model))
    dec = Decoder(model)
    torch._dynamo.reset()
    counters.clear()
    dec.compile(backend="aot_eager", dynamic_capacity=True)
    for n in (21, 90):
        ids, mask = padded_batch(2, n)
        with torch._dynamo.config.patch(error_on_recompile=n > 21):
            assert torch.equal(dec.generate(ids, 4, attention_mask=mask), eager.generate(ids, 4, attention_mask=mask))
    assert counters["stats"]["unique_graphs"] == 1


def test_settings_and_new_caches_keep_the_regional_step_right():
    """The dense setting and a larger cache (its own shapes: one compile each) after the KV setting;
    an audited step (eager) in between."""
    eager, dec = _pair("quest", layers=2)
    torch._dynamo.reset()
    dec.compile(backend="aot_eager")
    for setting, n in (("kv", 19), ("dense", 19), ("kv", 45)):
        eager.session.use(setting)
        dec.session.use(setting)
        ids, mask = padded_batch(2, n)
        assert torch.equal(_run(dec, ids, mask), _run(eager, ids, mask))
    ids, mask = padded_batch(1, 30)
    audited = dec.generate(ids, 4, attention_mask=mask, audit=True)
    assert torch.equal(audited, eager.generate(ids, 4, attention_mask=mask))
    assert dec.last_audit is not None


def test_what_cannot_compile_by_layer_compiles_the_whole_step():
    model = tiny_model("llama", layers=2)
    reads_hidden = Decoder(model, kv=LearnedQuest(0.5, page=4)).compile(backend="aot_eager")
    assert not reads_hidden.session.compiled_steps.regional
    with pytest.raises(ValueError, match="step context"):
        reads_hidden.compile(regional=True)
    thresholds = Decoder(tiny_model("llama", layers=2), proj=Threshold(0.5)).compile(backend="aot_eager")
    assert not thresholds.session.compiled_steps.regional
    assert layer_invariant(None, Threshold(0.5))[2]  # ... unless asked for: it may hold per-layer constants
    ok, why, _ = layer_invariant(None, TopK(0.5, mode="fast"))
    assert not ok and "mode='fast'" in why and layer_invariant(None, TopK(0.5))[0]
    whole = Decoder(tiny_model("llama", layers=2), kv=Quest(0.5, page=4)).compile(regional=False)
    assert not whole.session.compiled_steps.regional
