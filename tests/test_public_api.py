"""Sweeping checks of the public API (issue 15): every public constructor and every argument of
`Decoder.generate` and `Decoder.compile`, given bad values (wrong types, None, bools for ints,
lists, tensors, NaN, infinities, negatives, zero, huge numbers, out-of-range ratios), either accepts
them or raises a `ValueError` / `TypeError` whose message names the argument: never an error from
deep inside torch (an `IndexError`, a `RuntimeError`, an `AttributeError`, ...). Good values are
drawn too, and must work: a valid policy decodes, a valid `generate` call returns ``[B, T + new]``.

Each test varies one argument at a time (the others keep working values), so the argument a
message must name is known.
"""

from __future__ import annotations

import functools
import math
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import RecordingStreamer, padded_batch, tiny_model

from policyzoo import SSA, AttentionTopK, Certified, Decoder, Dense, EntmaxKV, Quest, Threshold, TopK, Window
from policyzoo._compat import PROJECTIONS
from policyzoo.gate import Gate

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DECODE_SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 128  # tiny_model's


# ------------------------------------------------------------------------------------ helpers
def outcome(call: typing.Callable[[], typing.Any], name: str) -> tuple[bool, typing.Any]:
    """``(True, result)`` when ``call`` succeeds, ``(False, None)`` when it raises a `ValueError` or
    `TypeError` naming ``name``; any other exception, or a message without the name, fails the test."""
    try:
        return True, call()
    except (ValueError, TypeError) as e:
        assert name in str(e), f"{type(e).__name__} does not name {name!r}: {e}"
        return False, None


def check(call: typing.Callable[[], typing.Any], name: str, kind: str) -> typing.Any:
    """A ``"good"`` value must be accepted, a ``"bad"`` one rejected by name, and ``"junk"`` either."""
    ok, result = outcome(call, name)
    assert ok or kind != "good", f"a valid {name} was rejected"
    assert not ok or kind != "bad", f"an invalid {name} was accepted"
    return result


def arg(good: st.SearchStrategy, bad: st.SearchStrategy = st.nothing()) -> st.SearchStrategy:
    """``(value, kind)``: a value from ``good`` (it must be accepted), from ``bad`` (it must be
    rejected with an error naming the argument) or from `JUNK` (either)."""
    return st.one_of(good.map(lambda v: (v, "good")), bad.map(lambda v: (v, "bad")), JUNK.map(lambda v: (v, "junk")))


HUGE = st.sampled_from([2**62 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1])
TENSORS = st.sampled_from([(1,), (0.5,), ([1, 2],), ([[1.0, 2.0]],), (True,)]).map(lambda args: torch.tensor(*args))
# Small ints only (besides the huge ones): a bad value that happens to be valid must stay cheap to run
# (a max_new_tokens of 10**6 is valid, and slow).
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=4),
    st.sampled_from(["", "1", "0.5", "sum", "cpu", "nan"]),
    st.integers(-3, 3),
    st.integers(max_value=-1),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-320, 1.5, -0.5, 1e300]),
    st.lists(st.integers(0, 3), max_size=3),
    st.tuples(st.integers(0, 3)),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
    TENSORS,
    st.builds(object),
)

MAX_COUNT = 2**62
NAN, INF = float("nan"), float("inf")
RATIO = st.floats(0.0, 1.0, exclude_min=True)
COUNT0 = st.one_of(st.integers(0, 64), st.integers(0, MAX_COUNT))
COUNT1 = st.one_of(st.integers(1, 64), st.integers(1, MAX_COUNT))
BUDGET = st.one_of(RATIO, COUNT1)
BUDGET0 = st.one_of(BUDGET, st.just(0))
AGGREGATE = st.sampled_from(["sum", "max"])
TARGETS = st.lists(st.sampled_from(list(PROJECTIONS)), min_size=1, max_size=7, unique=True).map(tuple)
# Values each kind of argument must refuse.
NOT_INT = [True, 4.0, "4", None, [4], torch.tensor(4)]
BAD_COUNT0 = st.sampled_from([-1, -(2**70), MAX_COUNT + 1, 2**63, *NOT_INT])
BAD_COUNT1 = st.one_of(BAD_COUNT0, st.just(0))
BAD_RATIO = st.sampled_from([0.0, -0.5, 1.0000001, 2.0, NAN, INF, -INF, True, "0.5", None, torch.tensor(0.5)])
BAD_BUDGET = st.one_of(BAD_RATIO, st.sampled_from([0, -3, MAX_COUNT + 1, 2**70, [8]]))
BAD_BUDGET0 = st.one_of(BAD_RATIO, st.sampled_from([-3, MAX_COUNT + 1, [8]]))  # 0 tokens is allowed
BAD_NAME = st.sampled_from(["", "SUM", "other", None, 1, ("sum",), torch.tensor([1, 2])])
BAD_NUMBER = st.sampled_from([NAN, INF, -INF, "1", None, True, [1.0], torch.tensor([1.0, 2.0])])
BAD_FLAG = st.sampled_from([1, 0, "yes", "", None, 1.0, torch.tensor(True), torch.tensor([True, False])])


RESCORE = st.one_of(st.just(0), st.floats(1.0, 1e6))  # off, or a candidate factor
BAD_RESCORE = st.one_of(BAD_NUMBER, st.sampled_from([0.5, -1.0, 1e-9]))

# ------------------------------------------------------------------------------ constructors
# One entry per constructor argument: (class, argument, base kwargs, good values, bad values).
QUEST = Quest(0.1, page=4)
CONSTRUCTOR_ARGS: list[tuple[type, str, dict, st.SearchStrategy, st.SearchStrategy]] = [
    (Window, "sinks", {}, COUNT0, BAD_COUNT0),
    (Window, "window", {}, COUNT1, BAD_COUNT1),
    (AttentionTopK, "budget", {}, st.one_of(RATIO, st.integers(36, MAX_COUNT)), st.one_of(BAD_BUDGET, st.integers(1, 35))),  # >= 4 + 32
    (AttentionTopK, "sinks", {}, COUNT0, BAD_COUNT0),
    (AttentionTopK, "window", {}, COUNT0, BAD_COUNT0),
    (AttentionTopK, "aggregate", {}, AGGREGATE, BAD_NAME),
    (Quest, "budget", {}, BUDGET, BAD_BUDGET),
    (Quest, "page", {}, COUNT1, BAD_COUNT1),
    (Quest, "sinks", {}, COUNT0, BAD_COUNT0),
    (Quest, "window", {}, COUNT0, BAD_COUNT0),
    (Quest, "aggregate", {}, AGGREGATE, BAD_NAME),
    (Quest, "rescore", {}, RESCORE, BAD_RESCORE),
    (SSA, "budget", {}, BUDGET0, BAD_BUDGET0),
    (SSA, "sample", {}, BUDGET0, BAD_BUDGET0),
    (SSA, "proxy", {}, st.sampled_from(["page", "exact"]), BAD_NAME),
    (SSA, "temperature", {}, st.floats(1e-6, 1e6), st.one_of(BAD_NUMBER, st.sampled_from([0, 0.0, -1.0]))),
    (SSA, "page", {}, COUNT1, BAD_COUNT1),
    (SSA, "sinks", {}, COUNT0, BAD_COUNT0),
    (SSA, "window", {}, COUNT0, BAD_COUNT0),
    (SSA, "aggregate", {}, AGGREGATE, BAD_NAME),
    (SSA, "scheme", {}, st.sampled_from(["with_replacement", "gumbel_topk"]), BAD_NAME),
    (SSA, "seed", {}, st.integers(0, 2**70), st.sampled_from([-1, *NOT_INT])),  # a seed, not a count: any size
    (SSA, "generator", {}, st.one_of(st.none(), st.builds(torch.Generator)), st.sampled_from([0, "cpu", torch.tensor(0)])),
    (SSA, "rescore", {}, RESCORE, BAD_RESCORE),
    (EntmaxKV, "budget", {}, BUDGET, BAD_BUDGET),
    (EntmaxKV, "alpha", {}, st.just(1.5), st.one_of(BAD_NUMBER, st.sampled_from([2.0, 1.0, torch.tensor(1.5)]))),
    (EntmaxKV, "mode", {}, st.sampled_from(["gaussian", "topk"]), BAD_NAME),
    (EntmaxKV, "attention", {}, st.sampled_from(["softmax", "entmax"]), BAD_NAME),
    (EntmaxKV, "page", {}, COUNT1, BAD_COUNT1),
    (EntmaxKV, "sinks", {}, COUNT0, BAD_COUNT0),
    (EntmaxKV, "window", {}, COUNT0, BAD_COUNT0),
    (EntmaxKV, "z", {}, st.floats(0, 10), st.one_of(st.floats(max_value=-1e-6, allow_nan=False), BAD_NUMBER)),
    (EntmaxKV, "iters", {}, st.integers(1, 10**6), BAD_COUNT1),
    (EntmaxKV, "rescore", {}, RESCORE, BAD_RESCORE),
    (Certified, "policy", {}, st.sampled_from([QUEST, AttentionTopK(0.2), EntmaxKV(64)]),
     st.sampled_from([Window(), Dense(), TopK(0.5), Certified(QUEST), Quest, "quest", None])),  # fmt: skip
    (Certified, "eps", {"policy": QUEST}, st.floats(0.0, 1.0), st.one_of(BAD_NUMBER, st.sampled_from([-0.1, 1.5]))),
    (Certified, "max_budget", {"policy": AttentionTopK(0.2)}, st.one_of(st.floats(0.2, 1.0), st.integers(36, MAX_COUNT)),
     st.one_of(BAD_BUDGET, st.integers(1, 35), st.floats(0.01, 0.19))),  # fmt: skip
    (Certified, "slack", {"policy": QUEST}, st.floats(0.0, 1e3), st.one_of(BAD_NUMBER, st.just(-1e-5))),
    (TopK, "keep", {}, RATIO, BAD_RATIO),
    (TopK, "mode", {}, st.sampled_from(["exact", "fast"]), BAD_NAME),
    (TopK, "ratios", {"mode": "fast"}, st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
     st.sampled_from([{"0.q": NAN}, {"0.q": INF}, {"0.q": "1"}, {0: 1.0}, None, "0.q"])),  # fmt: skip
    (TopK, "targets", {}, TARGETS, st.sampled_from(["q", "down", "qkv", (), ("q", "mlp"), (["q"],), ("q", None), {"q": 1}, None, 3])),
    (Threshold, "keep", {}, RATIO, BAD_RATIO),
    (Threshold, "targets", {}, TARGETS, st.sampled_from(["up", (), ("gate", 3), None])),
    (Threshold, "thresholds", {}, st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
     st.sampled_from([{"0.q": NAN}, {"0.q": INF}, {"0.q": "1"}, {0: 1.0}, {"0.q": None}, [("0.q", 1.0)], None, "0.q"])),  # fmt: skip
]


@pytest.mark.parametrize(
    ("cls", "name", "base", "good", "bad"), [pytest.param(*entry, id=f"{entry[0].__name__}.{entry[1]}") for entry in CONSTRUCTOR_ARGS]
)
@given(data=st.data())
@SETTINGS
def test_constructor_argument(cls, name, base, good, bad, data):
    value, kind = data.draw(arg(good, bad), label=name)
    made = check(lambda: cls(**{**base, name: value}), name, kind)
    if made is not None:
        assert repr(made)  # a made object is whole


# ------------------------------------------------------------------------------ valid policies decode
@functools.cache
def _decoder_model(role: str):
    """One tiny model per role: a Decoder takes its model over, so roles must not share one."""
    return tiny_model("llama", seed=len(role))


@st.composite
def valid_policies(draw):
    """Any built-in policy with every argument valid, counts up to the 2**62 limit."""
    count = st.one_of(st.integers(0, 24), st.sampled_from([10**6, 2**61]))
    budget = st.one_of(RATIO, st.integers(1, 40), st.sampled_from([10**6, MAX_COUNT]))
    page = draw(st.sampled_from([1, 2, 4, 8]))
    sinks, window = draw(count), draw(count)
    kind = draw(st.sampled_from(["window", "attn", "quest", "ssa", "entmax", "certified"]))
    if kind == "window":
        return Window(sinks=sinks, window=max(window, 1))
    if kind == "attn":
        b = draw(budget)
        if isinstance(b, int) and b < sinks + window:
            b = sinks + window if sinks + window <= MAX_COUNT else 0.5
        return AttentionTopK(b, sinks=sinks, window=window, aggregate=draw(AGGREGATE))
    if kind == "quest":
        return Quest(draw(budget), page=page, sinks=sinks, window=window, aggregate=draw(AGGREGATE),
                     rescore=draw(st.sampled_from([0, 1, 2.5])))
    if kind == "ssa":
        return SSA(
            draw(st.one_of(budget, st.just(0))), draw(st.one_of(budget, st.just(0))), proxy=draw(st.sampled_from(["page", "exact"])),
            temperature=draw(st.floats(0.01, 100)), page=page, sinks=sinks, window=window, aggregate=draw(AGGREGATE),
            scheme=draw(st.sampled_from(["with_replacement", "gumbel_topk"])), seed=draw(st.integers(0, 2**64)),
        )  # fmt: skip
    if kind == "entmax":
        return EntmaxKV(draw(budget), mode=draw(st.sampled_from(["gaussian", "topk"])), page=page, sinks=sinks, window=window,
                        z=draw(st.floats(0, 5)), iters=draw(st.integers(1, 12)), rescore=draw(st.sampled_from([0, 2])))  # fmt: skip
    inner = draw(st.sampled_from([Quest(0.1, page=page), EntmaxKV(0.1, page=page, mode="topk"), AttentionTopK(0.1, sinks=2, window=2)]))
    max_budget = draw(st.one_of(st.floats(0.1, 1.0), st.integers(4, 64)))  # not below the policies' 0.1
    return Certified(inner, eps=draw(st.floats(0.0, 1.0)), max_budget=max_budget, slack=draw(st.floats(0, 1)))


@given(policy=valid_policies(), proj=st.one_of(st.none(), st.builds(TopK, RATIO, TARGETS)))
@DECODE_SETTINGS
def test_valid_policies_decode(policy, proj):
    dec = Decoder(_decoder_model("policies"), kv=policy, proj=proj)
    ids, mask = padded_batch(2, 9, seed=3)
    out = dec.generate(ids, 3, attention_mask=mask)
    assert out.shape == (2, 12)
    assert int(out.min()) >= 0 and int(out.max()) < VOCAB


# ------------------------------------------------------------------------------ Decoder(...)
def _gate() -> Gate:
    return Gate({"dense": {16: 1.0, 64: 2.0}, "kv": {16: 0.5, 64: 1.0}})


DECODER_ARGS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "kv": (st.sampled_from([None, Quest(0.5, page=4), Window(2, 8), AttentionTopK(0.5)]), st.sampled_from([TopK(0.5), Dense])),
    "proj": (st.sampled_from([None, TopK(0.5), TopK(0.25, targets=("gate", "up", "down"))]), st.sampled_from([Quest(0.5), TopK])),
    "page_size": (st.one_of(st.none(), st.integers(1, 64), st.just(MAX_COUNT)), BAD_COUNT1.filter(lambda v: v is not None)),
    "compile": (st.booleans(), BAD_FLAG),
    "dtype": (st.sampled_from([None, torch.float32]), st.sampled_from([torch.bfloat16, torch.float64, torch.int64, "float32"])),
    "device": (
        st.sampled_from([None, "cpu", torch.device("cpu")]),
        st.sampled_from(["cuda", "cuda:0", "meta", "nonsense", "cpu:x", 0, 1, -1, "", "1"]),
    ),
    "gate": (st.one_of(st.none(), st.builds(_gate)), st.sampled_from([{"dense": {1: 1.0, 2: 2.0}}, "gate.json"])),
}


@pytest.mark.parametrize("name", list(DECODER_ARGS))
@given(data=st.data())
@SETTINGS
def test_decoder_argument(name, data):
    value, kind = data.draw(arg(*DECODER_ARGS[name]), label=name)
    check(lambda: Decoder(_decoder_model("constructor"), **{name: value}), name, kind)


@given(value=st.one_of(JUNK, st.builds(torch.nn.Linear, st.just(2), st.just(2)), st.builds(lambda: tiny_model("llama").model)))
@settings(max_examples=25, deadline=None)
def test_decoder_model_argument(value):
    check(lambda: Decoder(value), "model", "bad")


# ------------------------------------------------------------------------------ Decoder.compile(...)
COMPILE_ARGS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "mode": (st.sampled_from([None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]), st.just("fast")),
    "dynamic_capacity": (st.booleans(), BAD_FLAG),
    "cuda_graphs": (st.sampled_from([None, False]), st.one_of(st.just(True), BAD_FLAG.filter(lambda v: v is not None))),  # True: CUDA
    "backend": (st.sampled_from(["inductor", "eager", "aot_eager", lambda gm, inputs: gm.forward]), st.just("nope")),
    "regional": (st.sampled_from([None, False, True]), BAD_FLAG.filter(lambda v: v is not None)),
}


@pytest.mark.parametrize("name", list(COMPILE_ARGS))
@given(data=st.data())
@SETTINGS
def test_compile_argument(name, data):
    value, kind = data.draw(arg(*COMPILE_ARGS[name]), label=name)
    # A fresh Decoder each time (compiling is lazy: nothing is traced until a step runs).
    check(lambda: Decoder(_decoder_model("compile")).compile(**{name: value}), name, kind)


# ------------------------------------------------------------------------------ Decoder.generate(...)
@functools.cache
def _generate_decoder() -> Decoder:
    return Decoder(_decoder_model("generate"), kv=Quest(0.5, page=4), proj=TopK(0.5))


IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
GENERATE_ARGS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy, dict]] = {
    "max_new_tokens": (st.integers(1, 4), BAD_COUNT1, {}),
    "do_sample": (st.booleans(), BAD_FLAG, {}),
    "temperature": (st.floats(0.0, 1e300, exclude_min=True), st.one_of(BAD_NUMBER, st.sampled_from([0, 0.0, -1.0])), {"do_sample": True}),
    "top_p": (RATIO, BAD_RATIO, {"do_sample": True}),
    "attention_mask": (
        st.sampled_from([None, [[1, 1, 1, 1], [0, 0, 1, 1]], [[0, 1, 1, 1], [1, 1, 1, 1]]]).map(lambda m: m and torch.tensor(m)),
        st.sampled_from(
            [[[1, 1, 0, 1], [1, 1, 1, 1]], [[0, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 1, 1]], [[2, 2, 2, 2], [1, 1, 1, 1]], [[1, 1, 1], [1, 1, 1]]]
        ).map(torch.tensor),  # not left-padded, a row without a token, wrong shapes, not 0/1
        {},
    ),
    "streamer": (st.one_of(st.none(), st.builds(RecordingStreamer)), st.sampled_from([torch.zeros(2), print, "stdout", 0, RecordingStreamer]), {}),
    "eos_token_id": (
        st.one_of(st.none(), st.integers(0, VOCAB - 1), st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        st.sampled_from([VOCAB, -1, [1, VOCAB], [1, 2.0], [[1]], (1, "2"), 1.0, "2", True, [True], torch.tensor([1]), 2**70]),
        {},
    ),
    "pad_token_id": (st.one_of(st.none(), st.integers(0, VOCAB - 1)), st.sampled_from([VOCAB, -1, 1.0, "0", True, [0], 2**70]), {}),
    "generator": (
        st.one_of(st.none(), st.integers(0, 2**32).map(lambda s: torch.Generator().manual_seed(s))),
        st.sampled_from([0, "cpu", torch.tensor(0), torch.Generator]),
        {"do_sample": True},
    ),
    "audit": (st.booleans(), BAD_FLAG, {}),
    "progress": (st.booleans(), BAD_FLAG, {}),
    "output_logits": (st.booleans(), BAD_FLAG, {}),
}


def _check_generated(result, args: dict, ids: torch.Tensor) -> None:
    seq = result[0] if args.get("output_logits") else result
    b, t = ids.shape
    new = seq.shape[1] - t
    assert seq.shape[0] == b and 1 <= new <= args.get("max_new_tokens", 2)
    assert torch.equal(seq[:, :t], ids)
    assert int(seq.min()) >= 0 and int(seq.max()) < VOCAB
    if args.get("output_logits"):
        assert result[1].shape == (b, new, VOCAB)


@pytest.mark.parametrize("name", list(GENERATE_ARGS))
@given(data=st.data())
@SETTINGS
def test_generate_argument(name, data):
    good, bad, base = GENERATE_ARGS[name]
    value, kind = data.draw(arg(good, bad), label=name)
    args = {"max_new_tokens": 2, **base, name: value}
    result = check(lambda: _generate_decoder().generate(IDS, **args), name, kind)
    if result is not None:
        _check_generated(result, args, IDS)


@given(
    value=st.one_of(
        JUNK,
        st.sampled_from(
            [
                torch.ones(2, 3),  # float
                torch.ones(2, 3, dtype=torch.bool),
                torch.ones(2, 3, dtype=torch.int16),
                torch.ones(3, dtype=torch.long),  # 1-D
                torch.ones(1, 2, 3, dtype=torch.long),  # 3-D
                torch.ones(1, 0, dtype=torch.long),  # no tokens
                torch.tensor([[1, VOCAB]]),
                torch.tensor([[-1, 2]]),
                torch.tensor([[2**62, 2]]),
            ]
        ),
        st.lists(st.lists(st.integers(0, 5), min_size=2, max_size=2), min_size=1, max_size=2),
    )
)
@SETTINGS
def test_generate_input_ids(value):
    """Every value drawn is invalid (valid prompts: `test_generate_valid_arguments_together`)."""
    check(lambda: _generate_decoder().generate(value, 2), "input_ids", "bad")


def test_generate_input_ids_without_rows():
    with pytest.raises(ValueError, match="input_ids"):
        _generate_decoder().generate(torch.ones(0, 3, dtype=torch.long), 2)


@st.composite
def prompts(draw) -> list[list[int]]:
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    return draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=t, max_size=t), min_size=b, max_size=b))


@given(
    ids=prompts(),
    max_new_tokens=st.integers(1, 4),
    do_sample=st.booleans(),
    temperature=st.floats(0.05, 20),
    top_p=st.floats(0.01, 1.0),
    eos=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=4)),
    pad=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    seed=st.integers(0, 2**32),
    output_logits=st.booleans(),
    streamer=st.booleans(),
)
@settings(max_examples=25, deadline=None)
def test_generate_valid_arguments_together(ids, max_new_tokens, do_sample, temperature, top_p, eos, pad, seed, output_logits, streamer):
    ids = torch.tensor(ids)
    args = dict(
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_p=top_p, eos_token_id=eos,
        pad_token_id=pad, generator=torch.Generator().manual_seed(seed), output_logits=output_logits,
        streamer=RecordingStreamer() if streamer else None,
    )  # fmt: skip
    result = _generate_decoder().generate(ids, **args)
    _check_generated(result, args, ids)
    if streamer:
        assert args["streamer"].ended and torch.equal(args["streamer"].chunks[0], ids)


# ------------------------------------------------------------------------------ Gate(...)
CURVES = {"dense": {16: 1.0, 64: 2.0}, "kv": {16: 0.5, 64: 1.0}}
QUALITY = {"dense": 0.0, "kv": 0.1}
GATE_ARGS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy, dict]] = {
    "curves": (
        st.just(CURVES),
        st.sampled_from([{}, {"kv": CURVES["kv"]}, {"dense": {16: 1.0}}, {"dense": {16: -1.0, 64: 1.0}}, {"dense": {0: 1.0, 4: 1.0}},
                         {"dense": {16: float("nan"), 64: 1.0}}, {"fast": CURVES["kv"], **CURVES}, {"dense": [1, 2]}, {"dense": None}]),
        {},
    ),  # fmt: skip
    "quality": (
        st.one_of(st.none(), st.dictionaries(st.sampled_from(["dense", "proj", "kv", "both"]), st.floats(-1, 10), min_size=1)),
        st.sampled_from([{"dense": "x"}, {"fast": 0.1}, {"dense": float("nan")}, [1], [{"setting": "kv", "ppl_increase": "x"}]]),
        {},
    ),
    "max_ppl_increase": (st.one_of(st.none(), st.floats(0, 100)), st.one_of(BAD_NUMBER.filter(lambda v: v is not None), st.just(-0.1)),
                         {"quality": QUALITY}),
    "names": (st.none(), st.sampled_from([{"kv": "quest"}, {}]), {"quality": QUALITY}),  # names need a results file
    "device": (st.one_of(st.none(), st.text(max_size=8)), st.sampled_from([0, torch.device("cpu"), ["cpu"]]), {}),
    "kv_spec": (st.one_of(st.none(), st.text(max_size=8)), st.sampled_from([QUEST, 0, ["quest"]]), {}),
    "proj_spec": (st.one_of(st.none(), st.text(max_size=8)), st.sampled_from([TopK(0.5), 0.5]), {}),
    "meta": (st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.integers())), st.sampled_from(["x", [("a", 1)], 1, True]), {}),
}


@pytest.mark.parametrize("name", list(GATE_ARGS))
@given(data=st.data())
@SETTINGS
def test_gate_argument(name, data):
    good, bad, base = GATE_ARGS[name]
    value, kind = data.draw(arg(good, bad), label=name)
    if name == "quality" and isinstance(value, str):
        value = {"dense": value}  # a string is a results file's path (a missing one: FileNotFoundError)
    kwargs = {**base, name: value}
    curves = kwargs.pop("curves", CURVES)
    gate = check(lambda: Gate(curves, **kwargs), name, kind)
    if gate is not None:
        assert gate.choose(32.0) in gate.settings
        assert math.isfinite(gate.predict("dense", 32.0))
