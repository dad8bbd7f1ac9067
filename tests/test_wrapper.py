"""`kv.wrapper.PolicyWrapper`: a wrapper declares what its policy declares, and every wrapper around
every registered policy either decodes (at full budget, the dense tokens) or is refused at
construction with a message naming the pair."""

from __future__ import annotations

import pytest
import torch
from tiny_models import padded_batch, tiny_model

from policyzoo import (
    SSA, AttentionTopK, Certified, CommunityKV, Decoder, Dense, DepthSchedule, EntmaxKV, Forecast, KVSelector, PrHS, Quest, Window,
)  # fmt: skip
from policyzoo.kv.wrapper import PolicyWrapper
from policyzoo.spec import KV_POLICIES

# Every registered policy at full budget (small pages, so a tiny prompt spans many): each alone
# decodes the dense tokens. A new registered policy must join (the test below checks).
FULL = {
    "dense": lambda: Dense(),
    "window": lambda: Window(sinks=2, window=4096),
    "attn-topk": lambda: AttentionTopK(1.0, sinks=2, window=2),
    "quest": lambda: Quest(1.0, page=4, sinks=2, window=2),
    "ssa": lambda: SSA(1.0, 0, page=4, sinks=2, window=2),
    "ssa-sampled": lambda: SSA(1.0, 0.2, page=4, sinks=2, window=2),
    "entmax-kv": lambda: EntmaxKV(1.0, mode="topk", page=4, sinks=2, window=2),
    "entmax-kv-entmax": lambda: EntmaxKV(1.0, mode="topk", attention="entmax", page=4, sinks=2, window=2),
    "prhs": lambda: PrHS(Quest(1.0, page=4, sinks=2, window=2), time=0.9),
    "certified": lambda: Certified(Quest(1.0, page=4, sinks=2, window=2), eps=0.05, max_budget=1.0),
    "forecast": lambda: Forecast(1.0, block=8, kernel=8, stride=4, sinks=2, window=2, rank=4),
    "community-kv": lambda: CommunityKV(1.0, sinks=2, window=2),
}
# Every wrapper, in each of its ways of running the policy.
WRAPPERS = {
    "certified": lambda p: Certified(p, eps=0.05, max_budget=1.0),
    "prhs-time": lambda p: PrHS(p, time=0.9),
    "prhs-layer": lambda p: PrHS(p, layer=(0, 0)),
    "prhs-certified": lambda p: PrHS(p, eps=0.05, time=0.9, layer=(0, 0)),
    "prhs-depth": lambda p: PrHS(p, depth=DepthSchedule((1.0, 1.0), (getattr(p, "window", 2),) * 2)),
}


def test_every_registered_policy_and_wrapper_is_in_the_contract():
    names = {name.split("-entmax")[0].removesuffix("-sampled") for name in FULL}
    assert names == set(KV_POLICIES)
    wrappers = {cls for cls in KV_POLICIES.values() if issubclass(cls, PolicyWrapper)}
    assert wrappers == {Certified, PrHS} and {type(WRAPPERS[n](Quest(1.0, page=4, window=2))) for n in WRAPPERS} == wrappers


@pytest.fixture(scope="module")
def dense_tokens():
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(2, 27)
    want = Decoder(model).generate(ids, 6, attention_mask=mask)
    return model, ids, mask, want


@pytest.mark.parametrize("policy", list(FULL))
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_wrapper_around_any_policy_decodes_or_is_refused_by_name(wrapper, policy, dense_tokens):
    model, ids, mask, want = dense_tokens
    inner = FULL[policy]()
    try:
        wrapped = WRAPPERS[wrapper](inner)
    except (TypeError, ValueError) as e:
        message = str(e)
        assert ("Certified" if wrapper == "certified" else "PrHS") in message and type(inner).__name__ in message, message
        return
    assert isinstance(wrapped, PolicyWrapper) and wrapped.policy is inner
    for name in ("page_size", "slot_alignment", "attention", "weighted", "selects_ahead", "two_stage"):
        assert getattr(wrapped, name) == getattr(inner, name), name
    assert set(inner.summaries) <= set(wrapped.summaries) and set(inner.step_context) <= set(wrapped.step_context)
    dec = Decoder(model, kv=wrapped)
    if inner.attention == "entmax":  # an entmax model is another model: it decodes, against its own dense
        got = dec.generate(ids, 6, attention_mask=mask)
        assert torch.equal(got, Decoder(model, kv=EntmaxKV(1.0, mode="topk", attention="entmax", page=4)).generate(ids, 6, attention_mask=mask))
        return
    assert torch.equal(dec.generate(ids, 6, attention_mask=mask), want), f"{wrapper}({policy}) at full budget differs from dense"


def test_the_refusals_name_why():
    forecast = Forecast(0.5, block=8, kernel=8, stride=4, rank=4)
    with pytest.raises(ValueError, match=r"Certified\(Forecast\(...\)\): .*twice per layer"):
        Certified(forecast, eps=0.05)
    with pytest.raises(ValueError, match=r"PrHS\(Forecast\(...\)\): .*one layer ahead"):
        PrHS(forecast, time=0.9)
    with pytest.raises(ValueError, match=r"Certified\(SSA\(...\)\): .*weights"):
        Certified(SSA(0.2, 0.1))
    with pytest.raises(TypeError, match="Certified: policy must be a KV policy with a budget .* got Window"):
        Certified(Window())


def test_a_wrapper_shares_the_policys_learned_parts():
    """`Certified` scores twice (its policy at its budget and at max_budget): both with the same
    learned parts, which move and save as the wrapper's."""
    from tiny_models import LearnedQuest

    inner = LearnedQuest(0.5, page=4)
    wrapped = Certified(inner, eps=0.1, max_budget=1.0)
    assert wrapped.modules() == inner.modules() and wrapped._wide.head is inner.head
    assert wrapped.step_context == ("hidden",)
    model = tiny_model("llama", layers=2)
    ids, mask = padded_batch(1, 20)
    Decoder(model, kv=wrapped).generate(ids, 3, attention_mask=mask)
    assert wrapped._wide.head is inner.head


class _Sampling(KVSelector):
    """A policy whose random stream records its restarts."""

    restarts = 0

    def reset_random(self) -> None:
        self.restarts += 1


def test_a_wrapper_restarts_its_policys_random_stream():
    inner = _Sampling()
    PrHS(inner, time=0.9).reset_random()
    assert inner.restarts == 1
