"""Compiled decode steps: one per shape key, each with a code object of its own, replayed as CUDA graphs.

Dynamo keeps its compiled code on the *code object* of the function it compiles, and allows each code
object a few versions (``torch._dynamo.config.recompile_limit``, 8), whatever ``torch.compile``
wrapper the calls came through. Every Decoder compiles the same functions (`DecodeSession`'s step,
`regional.call_layer`), so without care the versions of every Decoder in a process pile up on one code
object: the ninth policy, prompt shape or setting falls back to eager, for good and silently. Here
each compiled step gets a copy of its function with a fresh code object (`own_code`), and a session
keeps one compiled step per *key* (setting, sampling mode and, for a fixed capacity, the cache's
batch and capacity: what the step's guards would tell apart anyway). A Decoder's steps then compile
once per key, in any process, beside any number of other Decoders.

If a compiled step still falls back (a recompile limit hit inside it, or graph breaks that leave parts
of it eager), `CompileFallbackWarning` says so, with Dynamo's reason: it is watched over its first
calls, where compiling happens.

On CUDA a step is warmed up (`WARMUP_STEPS` compiled runs), then captured in a CUDA graph that is
replayed directly: a replay costs the host tens of microseconds, a call through the guards
milliseconds on an 8B model. Every run is a real step: nothing is run twice or rolled back.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import warnings
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Sequence

import torch
from torch import Tensor, nn

from . import inductor_compat
from .regional import RegionalStep, call_layer

if TYPE_CHECKING:
    from .backend import Backend
    from .cache import PagedKVCache
    from .forward import ForwardArgs
    from .kv.context import ContextStore
    from .selection import Selection

WARMUP_STEPS = 2  # compiled runs of a new key before its CUDA graph is captured
WATCHED_CALLS = 3  # calls of a new compiled step watched for a fallback to eager (compiles happen there)
_DYNAMO_LOGGER = "torch._dynamo.convert_frame"  # where Dynamo reports a recompile limit hit

Step = Callable[[], tuple[Tensor, Tensor]]


class CompileFallbackWarning(UserWarning):
    """A compiled decode step runs (partly) eagerly: slower than compiled, same tokens."""


def own_code(fn: types.FunctionType, label: str) -> types.FunctionType:
    """A copy of ``fn`` with a code object of its own (named ``fn<label>`` in Dynamo's logs), so that
    what Dynamo compiles for it is counted and cached apart from every other copy."""
    name = f"{fn.__name__}<{label}>"
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") else fn.__code__.replace(co_name=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class _LimitHits(logging.Handler):
    """Collects Dynamo's "hit config.recompile_limit" reports while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message:
            self.hits.append(" ".join(line.strip() for line in message.splitlines()[:3]))


@contextmanager
def fallback_watch(label: str) -> Iterator[None]:
    """Warn (`CompileFallbackWarning`) if code run in the block makes Dynamo give up compiling
    (a recompile limit hit) or break the graph."""
    from torch._dynamo.utils import counters

    logger = logging.getLogger(_DYNAMO_LOGGER)
    handler = _LimitHits()
    breaks = sum(counters["graph_break"].values())
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.hits:
        warnings.warn(
            f"the compiled decode step of {label} fell back to eager: {handler.hits[-1]}. It decodes the same "
            "tokens, slower. Report it (with TORCH_LOGS=recompiles) if a policyzoo built-in did this",
            CompileFallbackWarning, stacklevel=4,
        )  # fmt: skip
    new_breaks = sum(counters["graph_break"].values()) - breaks
    if new_breaks:
        reasons = sorted(counters["graph_break"])[:3]
        warnings.warn(
            f"the compiled decode step of {label} has {new_breaks} graph break(s), so parts of it run eagerly: "
            f"{'; '.join(reasons)}",
            CompileFallbackWarning, stacklevel=4,
        )  # fmt: skip


class _Compiled:
    """One key's compiled step: warm-up runs (watched), then on CUDA its captured graph."""

    def __init__(self, step: Step, label: str, cuda_graphs: bool) -> None:
        self.step, self.label, self.cuda_graphs = step, label, cuda_graphs
        self.calls = 0
        self.runs = 0  # compiled runs since the graph was last dropped
        self.graph: tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]] | None = None

    def __call__(self) -> tuple[Tensor, Tensor]:
        if self.graph is not None:
            graph, outputs = self.graph
            graph.replay()
            return outputs
        if self.cuda_graphs and self.runs >= WARMUP_STEPS:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self._run()
            self.graph = (graph, outputs)
            graph.replay()
            return outputs
        self.runs += 1
        return self._run()

    def _run(self) -> tuple[Tensor, Tensor]:
        self.calls += 1
        if self.calls > WATCHED_CALLS:
            return self.step()
        with fallback_watch(self.label):
            return self.step()

    def drop_graph(self) -> None:
        self.graph = None
        self.runs = 0


class CompiledSteps:
    """A session's compiled decode steps, one per key (see the module docstring).

    ``build(label)`` makes a new compiled step (its function an `own_code` copy named by ``label``);
    calling with a key runs that key's step, building it on first use. ``regional``: the steps compile
    one decoder layer for every layer (`regional.RegionalStep`), not the whole step.
    """

    def __init__(self, build: Callable[[str], Step], *, name: str, cuda_graphs: bool, dynamic_capacity: bool, regional: bool) -> None:
        self.build, self.name = build, name
        self.cuda_graphs, self.dynamic_capacity, self.regional = cuda_graphs, dynamic_capacity, regional
        self._steps: dict[Hashable, _Compiled] = {}

    def __call__(self, key: tuple) -> tuple[Tensor, Tensor]:
        entry = self._steps.get(key)
        if entry is None:
            label = ":".join([self.name, *(str(part) for part in key)])
            entry = self._steps[key] = _Compiled(self.build(label), label, self.cuda_graphs)
        return entry()

    def __len__(self) -> int:
        return len(self._steps)

    def drop_graphs(self) -> None:
        """Forget the captured CUDA graphs (they read a cache or policy state that is gone): each key
        warms up and captures again; the compiled code stays."""
        for entry in self._steps.values():
            entry.drop_graph()

    @property
    def graphs(self) -> int:
        """The CUDA graphs captured now."""
        return sum(entry.graph is not None for entry in self._steps.values())


def compile_steps(
    step: types.MethodType,
    model: nn.Module,
    layer_args: Callable[[], "Sequence[ForwardArgs]"] | None,
    *,
    name: str,
    mode: str | None,
    dynamic_capacity: bool,
    cuda_graphs: bool,
    backend: str,
) -> CompiledSteps:
    """The compiled steps of a session whose step is the bound method ``step``: the whole step
    compiled, or, given ``layer_args`` (each layer's decode arguments, `regional.LayerRegions`), one
    decoder layer of ``model`` compiled for every layer around an eager rest of the step."""
    if backend == "inductor":
        inductor_compat.apply()
    if dynamic_capacity:
        # Inductor's rewrite of a scatter into a zero tensor as a pointwise select gave `SSA` a
        # wrong selection with symbolic sizes (a sampled page lost on caches of up to 8 pages;
        # aot_eager and this build match eager). `options` replaces `mode`: same settings.
        modal = torch._inductor.list_mode_options(mode) if mode else {}
        options = {**modal, "optimize_scatter_upon_const_tensor": False} if backend == "inductor" else None
        compile_fn = partial(torch.compile, backend=backend, options=options, dynamic=None)
    else:
        compile_fn = partial(torch.compile, backend=backend, mode=mode, dynamic=False)

    def build(label: str) -> Step:
        if layer_args is not None:
            return RegionalStep(model, layer_args, step, compile_fn(own_code(call_layer, label)))
        return compile_fn(types.MethodType(own_code(step.__func__, label), step.__self__))

    return CompiledSteps(build, name=name, cuda_graphs=cuda_graphs, dynamic_capacity=dynamic_capacity, regional=layer_args is not None)


def mark_capacity_dynamic(cache: "PagedKVCache") -> None:
    """Trace the cache's capacity as a symbol (``dynamic_capacity``)."""
    # maybe_: a value the code specialises on recompiles instead of raising.
    rings = {id(t) for layer in cache.windows for t in (cache.keys[layer], cache.values[layer])}  # O(window), fixed
    for t in cache.tensors():
        if t.dim() == 4 and id(t) not in rings:  # keys/values [B, H_kv, capacity, D], summaries [B, H_kv, pages, D]
            torch._dynamo.maybe_mark_dynamic(t, 2)


def mark_selection_dynamic(sel: "Selection") -> None:
    """Trace an eagerly made selection's width as a symbol (``dynamic_capacity``): it follows the
    capacity (a shared selection of every page), which the compiled layer takes as a symbol too."""
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(sel.indices, sel.indices.dim() - 1)


def policy_state_layout(backends: "Sequence[Backend]", contexts: "ContextStore | None") -> tuple:
    """Where the policy's per-request tensors live: ``(address, shape, dtype)`` of every tensor in the
    layers' states and the policy's request state (nested dicts, lists, tuples and dataclass fields
    included), in a fixed order. Equal for two requests exactly when a graph recorded on one reads
    the other's."""
    out: list = []

    def visit(value: object) -> None:
        if isinstance(value, Tensor):
            out.append((value.data_ptr(), tuple(value.shape), value.dtype))
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name))

    visit([list(backend.state.layer_states.values()) for backend in backends])
    visit(contexts.request if contexts is not None else None)
    return tuple(out)


__all__ = [
    "CompileFallbackWarning", "CompiledSteps", "WARMUP_STEPS", "compile_steps", "fallback_watch", "mark_capacity_dynamic",
    "own_code", "policy_state_layout",
]
