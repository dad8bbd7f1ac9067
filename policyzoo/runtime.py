"""`Runtime`: the decode state the model's hooks read while a session drives it.

The attention function (`policyzoo.attention`) and the projection wrappers (`policyzoo.proj`) sit
inside the HF model and cannot take arguments from the decode loop, so they read this object: the
phase of the forward pass, the KV policy, whether projections run sparse, the cache and per-layer
policy states, the step context and the audit recorder. Its one writer is
`policyzoo.session.DecodeSession`; everything else only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from torch import Tensor

from .cache import PagedKVCache
from .kv.base import KVSelector, KVState
from .kv.context import ContextStore
from .selection import Selection

Attention = Literal["softmax", "entmax"]
ATTENTIONS = ("softmax", "entmax")

# "prefill": dense attention over the prompt; "decode": the policy and sparse projections;
# "dense_decode": every page and dense projections (the reference pass of a comparison).
Phase = Literal["idle", "prefill", "decode", "dense_decode"]


class Recorder(Protocol):
    """What the hooks report to while an audit is on (`policyzoo.eval.audit.Audit`)."""

    def record_attention(
        self, layer: int, q: Tensor, cache: PagedKVCache, sel: Selection, out: Tensor, scale: float, attention: Attention = "softmax"
    ) -> None: ...

    def record_projection(self, name: str, keep: Tensor) -> None: ...


def attention_of(policy: KVSelector) -> Attention:
    """The attention of the model a KV policy serves (`KVSelector.attention`), checked."""
    attention = policy.attention
    if attention not in ATTENTIONS:
        raise ValueError(f"{type(policy).__name__}.attention must be 'softmax' or 'entmax', got {attention!r}")
    return attention


@dataclass
class Runtime:
    """Mutable decode state shared by the attention function and the projection wrappers.

    ``policy`` is the KV policy decode steps use and ``sparse_proj`` says whether the projection
    wrappers sparsify them (the session's setting: ``dense``, ``proj``, ``kv`` or ``both``).

    ``attention`` is the model's attention, ``"softmax"`` or ``"entmax"``; by default that of the
    policy the Runtime is built with (the Decoder's KV policy). It is a property of the model, not of
    a request: it stays when the dense setting swaps in the `Dense` stand-in, so the dense setting
    and the dense reference pass of an entmax model attend with entmax.
    """

    policy: KVSelector
    phase: Phase = "idle"
    # The prompt being prefilled: the cache slot of its position 0 (`DecodeSession.prompt_slot`),
    # whether any row has left padding; in chunks, the prompt position of this forward's first
    # token and whether it is the last chunk (the prompt's last token is in it).
    prompt_slot: int = 0
    prefill_padded: bool = True
    prefill_offset: int = 0
    prefill_last: bool = True
    cache: PagedKVCache | None = None
    states: list[KVState] = field(default_factory=list)
    contexts: ContextStore | None = None
    audit: Recorder | None = None
    sparse_proj: bool = True
    attention: Attention | None = None
    # False once a Decoder built later on the same model has taken the model's hooks over.
    active: bool = True
    # The session that drives this runtime (a weak reference): a Decoder taking the model over
    # retires it (`DecodeSession.retire`), so its cache, CUDA graphs and compiled steps go at once.
    owner: Callable[[], Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.attention is None:
            self.attention = attention_of(self.policy)
        elif self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'softmax' or 'entmax', got {self.attention!r}")
