"""`PolicyWrapper`: the base of policies that run another policy inside their own `select`
(`Certified`, `PrHS`).

Everything a policy declares (`KVSelector`'s page size, summaries, step-context parts, slot
alignment, attention, prefill, weights, learned parts, random stream, ...) is the wrapped policy's,
derived here once; a wrapper adds what it needs itself (`own_summaries`, `own_step_context`) and
says which policies it cannot take (`refuse`), at construction, in a message that names the pair.
So a wrapper composes with every policy by construction, or refuses it up front.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from .base import KVSelector, KVState


class PolicyWrapper(KVSelector):
    """A policy that runs ``self.policy`` (a dataclass field of the subclass) to make its selections."""

    policy: KVSelector

    # ------------------------------------------------------------------ what the wrapper adds
    own_summaries: tuple[str, ...] = ()
    own_step_context: tuple[str, ...] = ()

    def refuse(self, why: str) -> None:
        """Raise a `ValueError` naming this wrapper, its policy and ``why`` the pair cannot work."""
        raise ValueError(f"{type(self).__name__}({type(self.policy).__name__}(...)): {why}")

    def check_policy(self) -> None:
        """The checks every wrapper makes of its policy (call from ``__post_init__``)."""
        if not isinstance(self.policy, KVSelector):
            raise TypeError(f"{type(self).__name__}: policy must be a KV policy (a KVSelector), got {type(self.policy).__name__}")

    # ------------------------------------------------------------------ derived declarations
    @property
    def page_size(self) -> int | None:  # type: ignore[override]
        return self.policy.page_size

    @property
    def summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys((*self.policy.summaries, *self.own_summaries)))

    @property
    def step_context(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys((*self.policy.step_context, *self.own_step_context)))

    @property
    def slot_alignment(self) -> int | None:  # type: ignore[override]
        return self.policy.slot_alignment

    @property
    def attention(self) -> str:  # type: ignore[override]
        return self.policy.attention

    @property
    def own_prefill(self) -> bool:  # type: ignore[override]
        return self.policy.own_prefill

    @property
    def weighted(self) -> bool:  # type: ignore[override]
        return self.policy.weighted

    @property
    def selects_ahead(self) -> bool:  # type: ignore[override]
        return self.policy.selects_ahead

    @property
    def layer_invariant(self) -> bool:  # type: ignore[override]
        return self.policy.layer_invariant

    @property
    def two_stage(self) -> bool:  # type: ignore[override]
        return self.policy.two_stage

    # ------------------------------------------------------------------ forwarded life cycle
    def attach(self, model: nn.Module) -> None:
        self.policy.attach(model)

    def modules(self) -> dict[str, nn.Module]:  # the learned parts are the wrapped policy's
        return self.policy.modules()

    def reset_random(self) -> None:
        self.policy.reset_random()

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        self.policy.prefill(state, q, k, v)

    def finish_prefill(self, states: Sequence[KVState]) -> None:
        self.policy.finish_prefill(states)

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        self.policy.append(state, k, v)


__all__ = ["PolicyWrapper"]
