"""Per-layer backends: the session builds one per layer of its cache, by what the layer is (a device
layer, a sliding-window ring, an offloaded layer with its page cache, a layer that prefetches for
the one above), and each decodes by select → fetch → compute → observe. A one-layer view shares the
layer's tensors; an audit wraps the backends without changing what they compute."""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import pytest
import torch
from tiny_models import hybrid_model, padded_batch, tiny_model

from policyzoo import Decoder, Dense, Offload, Quest, Window
from policyzoo.backend import Audited, LayerBackend, WindowLayer, build_backends, layer_cache
from policyzoo.kv import Forecast

QUEST = dict(page=4, sinks=2, window=4)


def started(dec: Decoder, length: int = 40, batch: int = 2) -> Decoder:
    ids, mask = padded_batch(batch, length, seed=1)
    dec.session.prefill(ids, mask, capacity=length + 16)
    return dec


def kinds(backends) -> list[str]:
    def name(b) -> str:
        inner = getattr(b, "inner", None)
        return type(b).__name__ + (f"({name(inner)})" if inner is not None else "")

    return [name(b) for b in backends]


def test_a_device_model_gets_one_layer_backend_per_layer():
    dec = started(Decoder(tiny_model("llama", layers=3), kv=Quest(0.5, **QUEST)))
    backends = dec.session.backends
    assert kinds(backends) == ["LayerBackend"] * 3 and [b.layer for b in backends] == [0, 1, 2]
    assert all(b.state.layer == b.layer and b.state.cache is dec.session.cache for b in backends)
    assert len({id(b.state) for b in backends}) == 3  # each layer's own view of the cache


def test_window_layers_get_their_ring_and_full_layers_the_policy():
    dec = started(Decoder(hybrid_model("qwen2", window=8), kv=Quest(0.5, **QUEST)))  # layers 1, 2: windows
    backends = dec.session.backends
    assert kinds(backends) == ["LayerBackend", "WindowLayer", "WindowLayer"]
    assert backends[0].window is None and backends[1].window == backends[2].window == 8


def test_offloaded_layers_fetch_through_their_page_cache_and_the_layer_below_prefetches():
    forecast = dict(block=16, kernel=16, stride=4, sinks=4, window=4)
    dec = started(Decoder(tiny_model("llama", layers=3), kv=Forecast(0.3, **forecast), offload=Offload(2, cache=0.7)), 150)
    assert kinds(dec.session.backends) == [
        "Prefetching(LayerBackend)",  # layer 0 stages layer 1's predicted pages
        "Prefetching(Offloaded(LayerBackend))",
        "Offloaded(LayerBackend)",
    ]
    # The wrapper is built where the cache prefetches; it stages pages only where the policy predicts
    # the next layer's selection (Quest does not: `fetched_ahead`), and not at all with prefetch=False.
    dec = started(Decoder(tiny_model("llama", layers=3), kv=Quest(0.5, **QUEST), offload=Offload(1, cache=0.7)))
    assert kinds(dec.session.backends) == ["LayerBackend", "Prefetching(LayerBackend)", "Offloaded(LayerBackend)"]
    dec = started(Decoder(tiny_model("llama", layers=3), kv=Quest(0.5, **QUEST), offload=Offload(1, cache=0.7, prefetch=False)))
    assert kinds(dec.session.backends) == ["LayerBackend", "LayerBackend", "Offloaded(LayerBackend)"]


def test_build_backends_follows_the_cache():
    """`build_backends` is what the session calls: the same kinds from a cache alone."""
    dec = started(Decoder(hybrid_model("gemma3", window=8), kv=Quest(0.5, **QUEST)))
    s = dec.session
    again = build_backends(s.cache, s.contexts, s.attention, s.scale)
    assert kinds(again) == kinds(s.backends) == ["WindowLayer", "LayerBackend", "WindowLayer"]
    assert isinstance(again[1], LayerBackend) and isinstance(again[0], WindowLayer)


def test_a_view_is_layer_zero_of_a_one_layer_cache_over_the_same_tensors():
    dec = started(Decoder(tiny_model("llama", layers=3), kv=Quest(0.5, **QUEST)))
    cache = dec.session.cache
    for b in dec.session.backends:
        view = b.view()
        assert view.layer == 0 and view.cache.num_layers == 1
        assert view.cache.keys[0] is cache.keys[b.layer] and view.cache.page_max[0] is cache.page_max[b.layer]
        assert view.cache.length is cache.length  # one sequence state
    one = layer_cache(cache, 2)
    assert one.full_layers == (0,) and one.windows == {} and one.total_slots == cache.capacity


def test_an_audit_wraps_every_policy_layer_and_decodes_the_same_logits():
    ids, mask = padded_batch(2, 40, seed=2)
    plain = Decoder(tiny_model("llama", layers=2), kv=Quest(0.5, **QUEST))
    audited = Decoder(tiny_model("llama", layers=2), kv=Quest(0.5, **QUEST))
    for dec in (plain, audited):
        dec.session.prefill(ids, mask, capacity=60)
    token = torch.tensor([5, 9])
    want = plain.session.step(token)
    with audited.session.audit() as recorder:
        got = audited.session.step(token)
    torch.testing.assert_close(got, want)
    assert sorted(recorder.dropped_mass) == [0, 1] and all(len(v) == 1 for v in recorder.dropped_mass.values())


def test_audited_wraps_a_backend_and_forwards_what_it_is():
    dec = started(Decoder(tiny_model("llama", layers=2), kv=Quest(0.5, **QUEST)))
    inner = dec.session.backends[1]
    wrapped = Audited(inner, recorder=None)  # type: ignore[arg-type]
    assert wrapped.inner is inner and wrapped.layer == 1 and wrapped.cache is inner.cache and wrapped.state is inner.state
    assert wrapped.window is None and wrapped.attention is inner.attention


@pytest.mark.parametrize("make", [Dense, lambda: Window(sinks=2, window=8)], ids=["dense", "window"])
def test_a_selection_the_same_in_every_layer_is_made_once_a_step(make):
    """`Dense` and `Window` select from the cache's geometry alone: a decode step makes their
    selection in its first layer and the later layers reuse it, with the tokens of a select in every
    layer. A subclass with a select of its own selects in every layer."""
    policy = make()
    calls = []

    class Counting(type(policy)):
        def select(self, state, q):
            calls.append(state.layer)
            return super().select(state, q)

    ids, mask = padded_batch(2, 30, seed=3)
    model = tiny_model("llama", layers=3)
    counting = Counting(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})
    assert policy.same_every_layer and not counting.same_every_layer
    every_layer = Decoder(copy.deepcopy(model), kv=counting).generate(ids, 4, attention_mask=mask)
    assert calls.count(1) == calls.count(2) == 3  # 3 decode steps, each layer selecting
    dec = Decoder(model, kv=policy)
    with mock.patch.object(type(policy), "select", autospec=True, side_effect=type(policy).select) as select:
        once = dec.generate(ids, 4, attention_mask=mask)
    assert select.call_count == 3  # one a decode step (the prefill selects nothing for these policies)
    assert torch.equal(once, every_layer)
