"""The step context: what a KV policy may see beyond one layer at one step.

``state.context`` (a `StepContext`) gives a policy's `select`:

- ``index``: the decode step, an ``int64`` 0-dim tensor (0 at the first step after the prefill);
- ``previous``: this layer's `Selection` at the previous step (at step 0, the selection the policy
  made for the prompt's last token at the end of the prefill);
- ``below``: the previous layer's `Selection` at this step (``None`` in layer 0);
- ``hidden``: the hidden state entering this layer, ``[B, d_model]``;
- ``rotary``: ``(cos, sin)``, each ``[B, D_rot]``, the rotary embedding of the step's token that the
  model hands its layers (``None`` for a model without one), so a policy can rotate a query it
  makes itself (`kv.Forecast`) the way the model rotates its own;
- ``request``: the policy's state for this request, one object for all layers, kept across steps
  (`KVSelector.new_request` makes it; ``None`` for a policy that keeps none).

A policy's per-layer state that persists across steps is ``state.layer_state_of(policy)`` (a typed
object from `KVSelector.new_layer_state`).

A policy names the parts it reads in `KVSelector.step_context` (``"previous"``, ``"below"``,
``"hidden"``, ``"rotary"``): the session keeps only those (``index`` and ``request`` are always there), so a policy
that reads nothing costs nothing. Everything is a tensor the compiled step reads or writes in place,
never a Python number, so a compiled decode step replays the same graph at every step.

Tensors a policy keeps across steps (in its layer state or ``request``) must be made before the first
decode step (in `KVSelector.prefill`, which runs eagerly) and updated in place (``copy_``): a
compiled step replays a CUDA graph, whose outputs are overwritten by the next replay.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor

from ..selection import Selection

PARTS = ("previous", "below", "hidden", "rotary")


@dataclass
class StepContext:
    """One layer's view of the step context (see the module docstring)."""

    index: Tensor
    previous: Selection | None = None
    below: Selection | None = None
    hidden: Tensor | None = None
    rotary: tuple[Tensor, Tensor] | None = None
    request: object | None = None


def check_parts(parts: object, owner: str) -> tuple[str, ...]:
    """``parts`` as a tuple of known step-context part names, or a clear error."""
    if isinstance(parts, str) or not isinstance(parts, (tuple, list, frozenset, set)):
        raise TypeError(f"{owner}.step_context must be a tuple of names from {PARTS}, got {parts!r}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"{owner}.step_context: unknown parts {unknown}; known: {', '.join(PARTS)}")
    return tuple(parts)


class ContextStore:
    """The decode state behind every layer's `StepContext`, owned by a decode session.

    ``previous`` selections live in buffers made once per cache (`seed_previous`, eagerly, at the
    prefill) and are overwritten in place after each step's selection (`record`), so their addresses
    stay fixed for CUDA graphs. ``below``, ``hidden`` and ``shared`` (the step's one selection of a
    policy that selects the same in every layer, `share`) only live within one step (`end_step`
    drops them), so they never leave a compiled graph.
    """

    def __init__(self, num_layers: int, device: torch.device | str) -> None:
        self.num_layers = num_layers
        self.index = torch.zeros((), dtype=torch.long, device=device)
        self.previous: list[Selection | None] = [None] * num_layers
        self.hidden: list[Tensor | None] = [None] * num_layers
        self.rotary: tuple[Tensor, Tensor] | None = None  # the same for every layer of a step
        self.below: Selection | None = None
        self.shared: Selection | None = None
        self.request: object | None = None  # the policy's per-request state (`KVSelector.new_request`)
        self.keep_previous = False  # set by the session from the policy in use
        self.keep_hidden = False
        self.keep_rotary = False
        if self.index.device.type == "cuda":
            torch._dynamo.mark_static_address(self.index)

    def view(self, layer: int) -> StepContext:
        """Layer ``layer``'s `StepContext` now."""
        return StepContext(
            index=self.index,
            previous=self.previous[layer],
            below=self.below if layer > 0 else None,
            hidden=self.hidden[layer],
            rotary=self.rotary,
            request=self.request,
        )

    def reset(self, request: object | None = None) -> None:
        """A new sequence batch: step 0, the policy's fresh ``request`` state, no transient state."""
        self.index.zero_()
        self.request = request
        self.end_step()

    def seed_previous(self, layer: int, sel: Selection) -> None:
        """Keep ``sel`` (the selection for the prompt's last token) as layer ``layer``'s previous
        selection: copied into the existing buffers when they have its shape, else into new ones
        (eager code only: called at the prefill)."""
        buf = self.previous[layer]
        if buf is not None and _same_layout(buf, sel):
            _copy_selection(buf, sel)
            return
        buf = Selection(
            indices=sel.indices.clone(),
            count=sel.count.clone(),
            log_weight=None if sel.log_weight is None else sel.log_weight.clone(),
            block=sel.block,
        )
        if buf.indices.device.type == "cuda":
            for t in (buf.indices, buf.count, buf.log_weight):
                if t is not None:
                    torch._dynamo.mark_static_address(t)
        self.previous[layer] = buf

    def record(self, layer: int, sel: Selection) -> None:
        """After layer ``layer`` selected ``sel`` this step: it becomes the next layer's ``below``
        and, where kept, this layer's ``previous`` for the next step."""
        self.below = sel
        if self.keep_previous:
            buf = self.previous[layer]
            if buf is None or not _same_layout(buf, sel):
                raise RuntimeError(
                    "the KV policy reads the previous step's selection, but none of this shape was kept at "
                    "the prefill: a policy that names 'previous' in step_context must return selections of "
                    "one shape (K_max, block, log_weight or not) for a given cache"
                )
            _copy_selection(buf, sel)

    def share(self, sel: Selection) -> None:
        """Keep ``sel`` as this step's selection of every layer: the session makes it once, before
        the layers, for a policy that selects the same in every layer (`KVSelector.same_every_layer`)."""
        self.shared = sel

    def reusable(self, same_every_layer: bool) -> Selection | None:
        """This step's shared selection (`share`), where the policy makes the same one in every
        layer (its `KVSelector.same_every_layer`); else None, and the layer selects."""
        return self.shared if same_every_layer else None

    def record_hidden(self, layer: int, hidden: Tensor) -> None:
        """The hidden state entering layer ``layer`` (its last token's row), if the policy reads it."""
        if self.keep_hidden:
            self.hidden[layer] = hidden[:, -1] if hidden.dim() == 3 else hidden

    def record_rotary(self, position_embeddings: tuple[Tensor, Tensor] | None) -> None:
        """The ``(cos, sin)`` a decoder layer receives (its last token's row), if the policy reads it."""
        if self.keep_rotary and position_embeddings is not None:
            cos, sin = position_embeddings
            self.rotary = (cos[:, -1], sin[:, -1]) if cos.dim() == 3 else (cos, sin)

    def end_step(self) -> None:
        """Drop what lives only within one step."""
        self.below = None
        self.shared = None
        self.hidden = [None] * self.num_layers
        self.rotary = None

    def advance(self) -> None:
        """One decode step done (in place: a compiled step replays this)."""
        self.index.add_(1)


def _same_layout(buf: Selection, sel: Selection) -> bool:
    return (
        buf.indices.shape == sel.indices.shape
        and buf.block == sel.block
        and (buf.log_weight is None) == (sel.log_weight is None)
    )


def _copy_selection(buf: Selection, sel: Selection) -> None:
    if sel.indices is not buf.indices:
        buf.indices.copy_(sel.indices)
    if sel.count is not buf.count:
        buf.count.copy_(sel.count)
    if sel.log_weight is not None and sel.log_weight is not buf.log_weight:
        buf.log_weight.copy_(sel.log_weight)
