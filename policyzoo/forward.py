"""`ForwardArgs`: what one forward of the wrapped model tells the registered attention function.

The session passes it through the model's forward as the keyword argument ``policyzoo=...``;
Hugging Face models hand extra keyword arguments down, unchanged, to every decoder layer and from
there to the attention function (`policyzoo.attention.policyzoo_attention`). It is frozen: nothing
below the session writes it, and a new phase or a new prompt chunk is a new object.

It holds the phase, the KV policy this forward decodes with, one backend per decoder layer
(`policyzoo.backend`) and, in a prefill, where the prompt chunk goes (`PromptChunk`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor, nn

from .kv.base import KVSelector
from .kv.context import ContextStore

# "prefill": dense attention over the prompt; "decode": the policy's selection;
# "dense_decode": every page and dense projections (the reference pass of a comparison).
Phase = Literal["prefill", "decode", "dense_decode"]
PHASES = ("prefill", "decode", "dense_decode")

# The keyword the session passes the model's forward, and the attention function reads.
KWARG = "policyzoo"


class AttentionBackend(Protocol):
    """What the attention function asks of one decoder layer's backend (`policyzoo.backend.Backend`)."""

    contexts: ContextStore

    def prefill(self, args: "ForwardArgs", q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor: ...

    def decode(self, args: "ForwardArgs", q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor: ...


@dataclass(frozen=True)
class PromptChunk:
    """Where a prefill forward's tokens go: the cache slot of the prompt's position 0 (``slot``),
    whether any row has left padding (``padded``), the prompt position of this forward's first token
    (``offset``; a long unpadded prompt is prefilled in chunks) and whether the prompt's last token
    is in it (``last``)."""

    slot: int = 0
    padded: bool = True
    offset: int = 0
    last: bool = True


@dataclass(frozen=True, eq=False)
class ForwardArgs:
    """One forward's instructions to the attention function (see the module docstring).

    ``layers`` holds a backend per decoder layer, found by the attention module's ``layer_idx``;
    with ``single=True`` it holds one backend that serves whichever layer is called (a regionally
    compiled layer, `policyzoo.regional`, whose compiled code must not depend on the layer index).
    """

    phase: Phase
    policy: KVSelector
    layers: tuple[AttentionBackend, ...]
    prompt: PromptChunk | None = None
    single: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if (self.phase == "prefill") != (self.prompt is not None):
            raise ValueError("a prefill forward needs its PromptChunk, and only a prefill has one")
        if self.single and len(self.layers) != 1:
            raise ValueError(f"single=True serves every layer with one backend, got {len(self.layers)}")

    def backend(self, module: nn.Module) -> AttentionBackend:
        """The backend of the decoder layer whose attention module is ``module``."""
        if self.single:
            return self.layers[0]
        return self.layers[module.layer_idx]

    def for_layer(self, layer: AttentionBackend) -> "ForwardArgs":
        """These arguments with ``layer`` as the one backend of every layer (`single`)."""
        return ForwardArgs(self.phase, self.policy, (layer,), self.prompt, single=True)


__all__ = ["ForwardArgs", "KWARG", "AttentionBackend", "PHASES", "Phase", "PromptChunk"]
