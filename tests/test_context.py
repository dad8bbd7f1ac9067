"""Step context contract: what a KV policy sees beyond one layer at one step (`state.context`).

The step index counts decode steps; ``previous`` is this layer's selection one step earlier (the
prompt's last token's at step 0); ``below`` the previous layer's at this step; ``hidden`` the hidden
state entering the layer. A compiled step reads and writes all of it without recompiling.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from tiny_models import padded_batch, tiny_model

from policyzoo import Decoder, Quest, Window
from policyzoo.kv.base import KVState
from policyzoo.kv.context import PARTS, ContextStore, check_parts
from policyzoo.selection import Selection


@dataclass
class Probe(Quest):
    """Quest that writes down, eagerly, what its step context holds at every select."""

    step_context = PARTS
    seen: list = field(default_factory=list, repr=False, compare=False)

    def select(self, state, q):
        sel = super().select(state, q)
        ctx = state.context
        self.seen.append(
            {
                "layer": state.layer,
                "index": int(ctx.index),
                "previous": None if ctx.previous is None else (ctx.previous.indices.clone(), ctx.previous.count.clone()),
                "below": None if ctx.below is None else (ctx.below.indices.clone(), ctx.below.count.clone()),
                "hidden": None if ctx.hidden is None else ctx.hidden.clone(),
                "rotary": None if ctx.rotary is None else tuple(t.clone() for t in ctx.rotary),
                "mine": (sel.indices.clone(), sel.count.clone()),
            }
        )
        return sel


@dataclass
class Sticky(Quest):
    """Quest that reuses its previous selection on odd steps: a policy whose output depends on the
    step index and on the previous step's selection, as PrHS's reuse does."""

    step_context = ("previous",)

    def select(self, state, q):
        fresh = super().select(state, q)
        prev = state.context.previous
        if prev is None:  # the prefill's selection: there is no earlier step
            return fresh
        odd = state.context.index % 2 == 1
        return Selection(torch.where(odd, prev.indices, fresh.indices), torch.where(odd, prev.count, fresh.count), block=fresh.block)


def test_a_standalone_state_has_a_context_at_step_zero_with_nothing_recorded():
    from policyzoo.cache import PagedKVCache

    ctx = KVState(PagedKVCache(2, 1, 2, 8, 16, page_size=4), 0, 1.0).context
    assert int(ctx.index) == 0 and ctx.previous is None and ctx.below is None and ctx.hidden is None and ctx.request is None


def test_probe_sees_the_step_index_previous_and_below_selections_and_the_hidden_state():
    model = tiny_model("llama", layers=3)
    ids, mask = padded_batch(2, 21)
    probe = Probe(1.0, page=4, window=4)  # every page: the hidden states are dense, as HF computes them
    dec = Decoder(model, kv=probe)
    out = dec.generate(ids, 5, attention_mask=mask)
    layers = model.config.num_hidden_layers
    prefill, decode = probe.seen[:layers], probe.seen[layers:]
    assert [r["layer"] for r in prefill] == list(range(layers)) and all(r["previous"] is None for r in prefill)
    assert len(decode) == 4 * layers  # 5 tokens: the prefill chose the first, 4 steps the rest
    for i, r in enumerate(decode):
        step, layer = divmod(i, layers)
        assert r["index"] == step
        earlier = (prefill if step == 0 else decode)[layer if step == 0 else i - layers]
        assert all(torch.equal(a, b) for a, b in zip(r["previous"], earlier["mine"]))
        if layer == 0:
            assert r["below"] is None
        else:
            assert all(torch.equal(a, b) for a, b in zip(r["below"], decode[i - 1]["mine"]))
    # hidden: what the HF model's own forward has entering each layer at that position
    seq_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    with torch.no_grad():
        hf = model(out[:, :-1], attention_mask=seq_mask, position_ids=(seq_mask.cumsum(1) - 1).clamp(min=0), output_hidden_states=True)
    for i, r in enumerate(decode):
        step, layer = divmod(i, layers)
        want = hf.hidden_states[layer][:, ids.shape[1] + step]
        torch.testing.assert_close(r["hidden"], want, atol=1e-4, rtol=1e-4)
    # rotary: the model's own (cos, sin) at each row's position of the step's token (left padding
    # shifts the positions), the same in every layer
    positions = seq_mask.cumsum(1) - 1
    for i, r in enumerate(decode):
        step = i // layers
        cos, sin = model.model.rotary_emb(hf.hidden_states[0], positions[:, ids.shape[1] + step : ids.shape[1] + step + 1])
        torch.testing.assert_close(r["rotary"][0], cos[:, 0])
        torch.testing.assert_close(r["rotary"][1], sin[:, 0])


def test_a_policy_reading_the_previous_selection_compiles_once_and_matches_eager():
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3", layers=2)
    ids, mask = padded_batch(2, 37)
    eager = Decoder(copy.deepcopy(model), kv=Sticky(0.3, page=4, window=4)).generate(ids, 9, attention_mask=mask)
    plain = Decoder(copy.deepcopy(model), kv=Quest(0.3, page=4, window=4)).generate(ids, 9, attention_mask=mask)
    assert not torch.equal(eager, plain)  # the reuse changes the output: the test has power
    torch._dynamo.reset()
    counters.clear()
    dec = Decoder(model, kv=Sticky(0.3, page=4, window=4), compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = dec.generate(ids, 9, attention_mask=mask)
        second = dec.generate(ids, 9, attention_mask=mask)  # a new request restarts the index and history
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0


def test_the_session_keeps_only_the_parts_a_policy_reads():
    model = tiny_model("llama")
    ids, mask = padded_batch(1, 12)
    dec = Decoder(model, kv=Quest(0.5, page=4))  # reads no step context
    dec.generate(ids, 3, attention_mask=mask)
    contexts = dec.session.contexts
    assert not contexts.keep_previous and not contexts.keep_hidden and not contexts.keep_rotary
    assert contexts.previous == [None, None] and int(contexts.index) == 2
    # no layer hook on a model whose policy does not read the hidden state
    assert all(not block._forward_pre_hooks for block in model.model.layers)
    Decoder(model, kv=Probe(0.5, page=4))
    assert all(len(block._forward_pre_hooks) == 1 for block in model.model.layers)
    Decoder(model)  # a new Decoder takes the hooks away again
    assert all(not block._forward_pre_hooks for block in model.model.layers)


def test_step_context_parts_are_checked():
    assert check_parts(("previous", "hidden"), "P") == ("previous", "hidden")
    with pytest.raises(ValueError, match="unknown parts \\['future'\\]"):
        check_parts(("future",), "P")
    with pytest.raises(TypeError, match="tuple of names"):
        check_parts("previous", "P")

    @dataclass
    class Bad(Quest):
        step_context = ("next_layer",)

    with pytest.raises(ValueError, match="Bad.step_context"):
        Decoder(tiny_model("llama"), kv=Bad())


def test_a_previous_selection_of_another_shape_is_a_clear_error():
    store = ContextStore(1, "cpu")
    store.keep_previous = True
    sel = Selection(torch.zeros(1, 2, 3, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32), block=4)
    store.seed_previous(0, sel)
    store.record(0, sel)  # the same layout: copied in place
    wider = Selection(torch.zeros(1, 2, 5, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32), block=4)
    with pytest.raises(RuntimeError, match="selections of one shape"):
        store.record(0, wider)


def test_previous_buffers_keep_their_addresses_across_requests():
    """A captured CUDA graph reads ``previous`` from fixed addresses: a second request with the same
    cache refills the same buffers."""
    model = tiny_model("llama")
    ids, mask = padded_batch(2, 20)
    dec = Decoder(model, kv=Sticky(0.5, page=4, window=4))
    dec.generate(ids, 4, attention_mask=mask)
    before = [p.indices.data_ptr() for p in dec.session.contexts.previous]
    dec.generate(ids, 4, attention_mask=mask)
    assert [p.indices.data_ptr() for p in dec.session.contexts.previous] == before


def test_the_request_state_is_one_object_for_every_layer_and_fresh_per_request():
    seen, made = [], []

    @dataclass
    class Layers:
        visited: list = field(default_factory=list)

    @dataclass
    class Counting(Window):
        def new_request(self):
            made.append(Layers())
            return made[-1]

        def select(self, state, q):
            request = state.context.request
            assert request is state.request_for(self)
            request.visited.append(state.layer)
            seen.append(len(request.visited))
            return super().select(state, q)

    model = tiny_model("llama")
    ids, mask = padded_batch(1, 10)
    dec = Decoder(model, kv=Counting(sinks=1, window=4))
    dec.generate(ids, 3, attention_mask=mask)  # 2 steps x 2 layers
    assert seen == [1, 2, 3, 4] and len(made) == 1
    dec.generate(ids, 2, attention_mask=mask)
    assert seen[4:] == [1, 2] and len(made) == 2 and made[1] is not made[0]


def test_a_state_outside_a_session_makes_its_request_state_on_first_use(make_case):
    case = make_case(b=1, h_kv=1, g=1, d=8, page=4, prompt=12, steps=0, starts=[0], seed=0)

    @dataclass
    class Keeping(Window):
        def new_request(self):
            return Layers()

    @dataclass
    class Layers:
        visited: list = field(default_factory=list)

    state, policy = case.state(), Keeping(sinks=1, window=4)
    assert state.context.request is None
    first = state.request_for(policy)
    assert isinstance(first, Layers) and state.request_for(policy) is first and state.context.request is first
