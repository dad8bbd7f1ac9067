"""`policyzoo.compiled`: compiled decode steps with code of their own. A process compiles any number of
Decoders, with any policies and prompt shapes, without one of them falling back to eager; a step
that falls back anyway says so."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from tiny_models import BUILTIN_POLICIES, padded_batch, tiny_model
from torch._dynamo.utils import counters

from policyzoo import Decoder, TopK
from policyzoo.compiled import CompileFallbackWarning, fallback_watch, own_code


class _LimitLog(logging.Handler):
    """Every "hit config.*recompile_limit" report Dynamo logs while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "hit config." in record.getMessage():
            self.hits.append(record.getMessage())


def _add(x, n):
    return x + n


def test_own_code_gives_a_function_its_own_compiled_versions():
    """Each copy has its own code object: Dynamo counts its versions apart (the recompile limit is
    per code object), and the copy computes what the original does."""
    a, b = own_code(_add, "a"), own_code(_add, "b")
    assert a.__code__ is not b.__code__ and a.__name__ == "_add<a>"
    assert a(2, 3) == _add(2, 3) == 5
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        for fn in (a, b):  # one version each: neither reaches a limit of 1
            compiled = torch.compile(fn, backend="eager", dynamic=False)
            with fallback_watch("copy"):
                assert torch.equal(compiled(torch.ones(2), 1), torch.full((2,), 2.0))


def test_a_step_that_falls_back_to_eager_says_so():
    compiled = torch.compile(_add, backend="eager", dynamic=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(torch.ones(2), 1)
        with pytest.warns(CompileFallbackWarning, match="fell back to eager.*recompile_limit"):
            with fallback_watch("a toy step"):
                compiled(torch.ones(2), 2)  # a new int: a second version, over the limit


def test_graph_breaks_in_a_step_are_reported():
    def breaks(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    torch._dynamo.reset()
    compiled = torch.compile(breaks, backend="eager")
    with pytest.warns(CompileFallbackWarning, match="graph break"):
        with fallback_watch("a toy step"):
            compiled(torch.ones(2))


# Eleven Decoders, each compiled for two prompt lengths (static capacity: two versions each), share
# one process: 22 compiles, nearly three times Dynamo's default recompile limit of 8.
MANY = ["dense", "window", "attn-topk", "quest", "quest-sketch", "ssa-page", "entmax-kv", "certified-quest", "prhs", "forecast",
        "community-kv"]  # fmt: skip


def test_a_process_compiles_many_decoders_and_none_falls_back():
    model = tiny_model("llama", layers=2)
    prompts = [padded_batch(2, n) for n in (13, 29)]  # caches of 20 and 36 slots: two compiles per Decoder
    logger = logging.getLogger("torch._dynamo.convert_frame")
    log = _LimitLog()
    torch._dynamo.reset()
    counters.clear()
    logger.addHandler(log)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)
            for name in MANY:
                proj = TopK(0.5) if name == "quest" else None  # a composition among them
                eager = Decoder(copy.deepcopy(model), kv=BUILTIN_POLICIES[name](), proj=copy.deepcopy(proj))
                dec = Decoder(model, kv=BUILTIN_POLICIES[name](), proj=proj).compile(backend="eager")
                for ids, mask in prompts:
                    got = dec.generate(ids, 5, attention_mask=mask)
                    assert torch.equal(got, eager.generate(ids, 5, attention_mask=mask)), f"{name}: compiled tokens differ from eager"
                assert len(dec.session.compiled_steps) == 2, name
    finally:
        logger.removeHandler(log)
    assert log.hits == []
    assert counters["frames"]["total"] == counters["frames"]["ok"] == 2 * len(MANY)
    assert sum(counters["graph_break"].values()) == 0


def test_settings_and_sampling_modes_compile_apart_and_once():
    """The setting and the sampling mode are part of a step's key: switching back and forth
    compiles each once, and the step of each decodes what eager decodes."""
    model = tiny_model("qwen2", layers=1)
    eager = Decoder(copy.deepcopy(model), kv=BUILTIN_POLICIES["quest"](), proj=TopK(0.5))
    dec = Decoder(model, kv=BUILTIN_POLICIES["quest"](), proj=TopK(0.5)).compile(backend="eager")
    ids, mask = padded_batch(2, 17)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        for setting in dec.available_settings():
            for d in (eager, dec):
                d.use(setting)
            assert torch.equal(dec.generate(ids, 4, attention_mask=mask), eager.generate(ids, 4, attention_mask=mask)), setting
        g = torch.Generator().manual_seed(0)
        sampled = dec.generate(ids, 4, attention_mask=mask, do_sample=True, generator=g)
        want = eager.generate(ids, 4, attention_mask=mask, do_sample=True, generator=torch.Generator().manual_seed(0))
        assert torch.equal(sampled, want)
    assert len(dec.session.compiled_steps) == 5  # four settings greedy, one sampled
    assert counters["frames"]["total"] == counters["frames"]["ok"] == 5
