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
changes). Each layer is therefore called with decode arguments of its own (`ForwardArgs.for_layer`):
its backend as layer 0 of a one-layer cache (`backend.Backend.view`), so every layer reads the same
Python values and its own tensors, which Dynamo takes as graph inputs. While a regional step runs,
each decoder layer's call goes through torch's compiled-call slot of `nn.Module` (the one
``Module.compile`` fills), which puts the layer's arguments in place of the step's; outside the
step the model is the plain eager model.

So a policy compiles by layer only when its ``select`` depends on its layer through these tensors
alone (`layer_invariant`): the built-in policies and `TopK` do; a policy that reads the step context
(``previous``, ``below``, ``hidden``) or indexes something of its own by ``state.layer``, and a
sparsifier with per-projection constants (`Threshold`, fast `TopK`), compile the whole step (`Decoder.compile`'s
``regional=False``, the default for them).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from . import _compat
from .forward import KWARG, ForwardArgs
from .kv.base import KVSelector


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


class LayerRegions:
    """Runs a step with one compiled function for every decoder layer of ``model``.

    ``compiled`` is `call_layer` compiled; ``layer_args()`` gives each layer's decode arguments
    (`ForwardArgs.for_layer`). Inside `active`, every decoder layer calls ``compiled`` with its own
    arguments in place of the step's; outside, the model is the plain eager model (the prefill,
    audited steps and the dense reference pass never see the compiled layer).
    """

    def __init__(self, model: nn.Module, layer_args: Callable[[], Sequence[ForwardArgs]], compiled: Callable) -> None:
        self.blocks = list(_compat.decoder_layers(model))
        self.layer_args = layer_args
        self.compiled = compiled

    @contextmanager
    def active(self) -> Iterator[None]:
        calls = [partial(_call_with, self.compiled, block, args) for block, args in zip(self.blocks, self.layer_args())]
        saved = [block._compiled_call_impl for block in self.blocks]
        try:
            for block, call in zip(self.blocks, calls):
                block._compiled_call_impl = call
            yield
        finally:
            for block, impl in zip(self.blocks, saved):
                block._compiled_call_impl = impl

    def run(self, step: Callable[[], Any]) -> Any:
        with self.active():
            return step()


def _call_with(compiled: Callable, block: nn.Module, layer_args: ForwardArgs, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's call with its own decode arguments in place of the step's."""
    kwargs[KWARG] = layer_args
    return compiled(block, *args, **kwargs)


class RegionalStep:
    """A decode step run with one compiled layer for every decoder layer of ``model``
    (`LayerRegions`): the session builds it around its own step function and calls it in place of
    the whole step compiled."""

    def __init__(self, model: nn.Module, layer_args: Callable[[], Sequence[ForwardArgs]], step: Callable[[], Any],
                 compiled_layer: Callable) -> None:
        self.regions = LayerRegions(model, layer_args, compiled_layer)
        self.step = step

    def __call__(self) -> Any:
        return self.regions.run(self.step)


__all__ = ["LayerRegions", "RegionalStep", "call_layer", "layer_invariant"]
