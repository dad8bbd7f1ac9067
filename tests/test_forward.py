"""`ForwardArgs`: what one forward tells the attention function. Frozen; a prefill carries its
`PromptChunk` and a decode none; the backend of a layer is found by its attention module's
``layer_idx``, or is the one backend of a regionally compiled layer (``single``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_model

from policyzoo import Decoder, Quest
from policyzoo.forward import KWARG, PHASES, ForwardArgs, PromptChunk
from policyzoo.kv.dense import Dense


def test_the_keyword_and_phases_are_the_documented_ones():
    assert KWARG == "policyzoo" and set(PHASES) == {"prefill", "decode", "dense_decode"}


def test_a_prefill_needs_its_chunk_and_a_decode_has_none():
    backends = ("a", "b")
    ForwardArgs("prefill", Dense(), backends, PromptChunk(slot=3, padded=False, offset=16, last=False))
    ForwardArgs("decode", Dense(), backends)
    with pytest.raises(ValueError, match="needs its PromptChunk"):
        ForwardArgs("prefill", Dense(), backends)
    with pytest.raises(ValueError, match="only a prefill"):
        ForwardArgs("decode", Dense(), backends, PromptChunk())
    with pytest.raises(ValueError, match="phase must be one of"):
        ForwardArgs("verify", Dense(), backends)  # type: ignore[arg-type]


def test_arguments_are_frozen_and_find_a_layers_backend_by_its_index():
    model = tiny_model("llama", layers=3)
    attn = [layer.self_attn for layer in model.model.layers]
    args = ForwardArgs("decode", Dense(), ("b0", "b1", "b2"))
    assert [args.backend(m) for m in attn] == ["b0", "b1", "b2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.phase = "prefill"  # type: ignore[misc]
    one = args.for_layer("b1")
    assert one.single and one.layers == ("b1",) and one.phase == "decode" and one.policy is args.policy
    assert [one.backend(m) for m in attn] == ["b1"] * 3  # one backend serves every layer
    with pytest.raises(ValueError, match="single=True serves every layer with one backend"):
        ForwardArgs("decode", Dense(), ("b0", "b1"), single=True)


def test_a_session_passes_its_backends_down_and_sets_nothing_on_the_model():
    """The session's decode arguments hold one backend per layer, made once per cache; the model's
    modules carry no policyzoo attribute."""
    model = tiny_model("llama", layers=2)
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    dec = Decoder(model, kv=Quest(0.5, page=4))
    ids = torch.randint(1, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    dec.generate(ids, 4)
    args = dec.session.open_step()
    assert args.phase == "decode" and args.policy is dec.kv and args.layers == dec.session.backends
    assert [b.layer for b in args.layers] == [0, 1]
    after = {name: set(vars(m)) for name, m in model.named_modules()}
    added = {name: sorted(after[name] - before[name]) for name in before if after[name] - before[name]}
    assert not any("policyzoo" in attr for attrs in added.values() for attr in attrs), added
