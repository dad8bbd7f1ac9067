"""Regional compilation of the decode step: one compiled decoder layer, reused by every layer.

`torch.compile` of the whole step traces every layer of the model, each with its own copy of the KV
policy's `select`, into one graph: Dynamo, AOTAutograd and Inductor then work through 32 copies of
the same code, and the time grows with it (minutes for an 8B model and a policy with a large
`select`). Here the decoder layer is compiled instead, once, and the compiled code serves all layers:
the rest of the step (embedding, final norm, LM head, the sampler) runs eagerly around it, and on CUDA
the session's CUDA graph captures it all, so the replayed step launches the same kernels either way
(less the fusions across a layer boundary).

One compiled layer serves every layer only if nothing it reads tells the layers apart but tensors
(Dynamo specialises the compiled code on every Python value it reads, and recompiles when one
changes). The attention function finds its layer through ``module._policyzoo = (runtime, layer)``,
and the policy reads ``state.layer`` and the cache's per-layer lists: for the compiled steps, each
attention module's handle is swapped for ``(LayerRuntime, 0)``, a view of the runtime that holds
only that layer's cache tensors, at index 0 (`LayerRuntime`). Every layer then reads the same Python
values and its own tensors, which Dynamo takes as graph inputs.

So a policy compiles by layer only when its ``select`` depends on its layer through these tensors
alone (`layer_invariant`): the built-in policies and `TopK` do; a policy that reads the step context
(``previous``, ``below``, ``hidden``) or indexes something of its own by ``state.layer``, and a
sparsifier with per-projection constants (`Threshold`, fast `TopK`), compile the whole step (`Decoder.compile`'s
``regional=False``, the default for them).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn

from . import _compat
from .cache import PagedKVCache
from .kv.base import KVSelector, KVState
from .kv.context import ContextStore, StepContext
from .selection import Selection


def call_layer(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The compiled unit: one decoder layer's call (hooks included)."""
    return block._call_impl(*args, **kwargs)


def layer_invariant(kv: KVSelector | None, proj: Any) -> tuple[bool, str, bool]:
    """``(ok, why not, forceable)``: whether one compiled layer can serve every layer of a step
    decoded with KV policy ``kv`` and projection sparsifier ``proj`` (see the module docstring), as
    they declare it (`KVSelector.layer_invariant`, `ProjectionSparsifier.layer_invariant`). One that
    does not declare it may read ``state.layer`` or keep per-layer constants, so it is refused unless
    asked for (``forceable``). A policy that reads the step context is refused outright: the layer
    views keep no previous selection and no hidden state.
    """
    if kv is not None and kv.step_context:
        return False, f"{type(kv).__name__} reads the step context {tuple(kv.step_context)}", False
    if kv is not None and not kv.layer_invariant:
        return False, f"{type(kv).__name__} does not declare layer_invariant (its select may depend on state.layer)", True
    if proj is not None and not proj.layer_invariant:
        return False, f"{proj!r} does not declare layer_invariant (its projections may differ by layer)", True
    return True, "", True


def layer_cache(cache: PagedKVCache, layer: int) -> PagedKVCache:
    """A one-layer view of ``cache``: layer ``layer``'s tensors as layer 0 (the same tensors, no
    copy; ``length`` and ``start`` shared), so every method works on it as on the cache."""
    view = copy.copy(cache)
    view.num_layers = 1
    view.keys, view.values = [cache.keys[layer]], [cache.values[layer]]
    for name in cache.summaries:
        setattr(view, name, [getattr(cache, name)[layer]])
    view.host_layers = frozenset({0}) if layer in cache.host_layers else frozenset()
    view.page_caches = {0: cache.page_caches[layer]} if layer in cache.page_caches else {}
    return view


class LayerContexts:
    """Layer ``layer``'s view of the session's `ContextStore` (as layer 0): the step index, the
    request state and the layer below's selection at this step (``None`` in layer 0). A layer-invariant
    policy keeps no previous selection and no hidden state."""

    keep_previous = False
    keep_hidden = False
    keep_rotary = False

    def __init__(self, main: ContextStore, layer: int) -> None:
        self.main = main
        self.first = layer == 0

    def view(self, layer: int) -> StepContext:
        return StepContext(index=self.main.index, below=None if self.first else self.main.below, request=self.main.request)

    def record(self, layer: int, sel: Selection) -> None:
        self.main.below = sel


class LayerRuntime:
    """What the attention function reads of the `Runtime` for one layer, as layer 0: that layer's
    cache view (`layer_cache`), state and step context; the rest is the runtime's own."""

    def __init__(self, main: Any, layer: int) -> None:
        self.main = main
        self.cache = layer_cache(main.cache, layer)
        self.contexts = LayerContexts(main.contexts, layer)
        state = main.states[layer]
        self.states = [KVState(self.cache, 0, state.scale, store=state.store, contexts=self.contexts)]

    @property
    def phase(self) -> str:
        return self.main.phase

    @property
    def policy(self) -> KVSelector:
        return self.main.policy

    @property
    def attention(self) -> str:
        return self.main.attention

    @property
    def audit(self) -> Any:
        return self.main.audit


class LayerRegions:
    """Runs a step with one compiled function for every decoder layer of ``model``.

    ``compiled`` is `call_layer` compiled. Inside `active`, every decoder layer calls it (through
    the layer's ``_compiled_call_impl``, which `nn.Module.__call__` takes when set) and every
    attention module reads its `LayerRuntime`; outside, the model is the plain eager model (the
    prefill, audited steps and the dense reference pass never see the compiled layer).
    """

    def __init__(self, model: nn.Module, runtime: Any, compiled: Callable) -> None:
        self.runtime = runtime
        self.blocks = list(_compat.decoder_layers(model))
        self.attention = _compat.attention_modules(model)
        self.calls = [partial(compiled, block) for block in self.blocks]
        self._views: list[LayerRuntime] = []
        self._built_for: tuple = ()

    def views(self) -> list[LayerRuntime]:
        """The layers' runtime views, made again for a new cache (or step context)."""
        key = (self.runtime.cache, self.runtime.contexts)
        if self._built_for != key or len(self._views) != len(self.blocks):
            self._views = [LayerRuntime(self.runtime, layer) for layer in range(len(self.blocks))]
            self._built_for = key
        return self._views

    @contextmanager
    def active(self) -> Iterator[None]:
        views = self.views()
        saved = [(block._compiled_call_impl, attn._policyzoo) for block, attn in zip(self.blocks, self.attention)]
        try:
            for block, attn, call, view in zip(self.blocks, self.attention, self.calls, views):
                block._compiled_call_impl = call
                attn._policyzoo = (view, 0)
            yield
        finally:
            for (impl, handle), block, attn in zip(saved, self.blocks, self.attention):
                block._compiled_call_impl = impl
                attn._policyzoo = handle

    def run(self, step: Callable[[], Any]) -> Any:
        with self.active():
            return step()


class RegionalStep:
    """A decode step run with one compiled layer for every decoder layer of ``model``
    (`LayerRegions`): the session builds it around its own step function and calls it in place of
    the whole step compiled."""

    def __init__(self, model: nn.Module, runtime: Any, step: Callable[[], Any], compiled_layer: Callable) -> None:
        self.regions = LayerRegions(model, runtime, compiled_layer)
        self.step = step

    def __call__(self) -> Any:
        return self.regions.run(self.step)


__all__ = ["LayerRegions", "LayerRuntime", "RegionalStep", "call_layer", "layer_cache", "layer_invariant"]
