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


def _of_policy(name: str) -> property:
    """A read-only attribute that is the wrapped policy's attribute ``name``."""
    return property(lambda self: getattr(self.policy, name), doc=f"The wrapped policy's ``{name}``.")


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
    # Each of these is the wrapped policy's own declaration (`KVSelector` says what each means).
    page_size = _of_policy("page_size")  # type: ignore[assignment]
    slot_alignment = _of_policy("slot_alignment")  # type: ignore[assignment]
    attention = _of_policy("attention")  # type: ignore[assignment]
    own_prefill = _of_policy("own_prefill")  # type: ignore[assignment]
    weighted = _of_policy("weighted")  # type: ignore[assignment]
    selects_ahead = _of_policy("selects_ahead")  # type: ignore[assignment]
    layer_invariant = _of_policy("layer_invariant")  # type: ignore[assignment]
    two_stage = _of_policy("two_stage")  # type: ignore[assignment]
    # Not derived: a wrapper's selection is its own, which may differ by layer where the policy's does not.
    same_every_layer = False

    @property
    def summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys((*self.policy.summaries, *self.own_summaries)))

    @property
    def step_context(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys((*self.policy.step_context, *self.own_step_context)))

    # ------------------------------------------------------------------ forwarded life cycle
    def attach(self, model: nn.Module) -> None:
        self.policy.attach(model)

    def modules(self) -> dict[str, nn.Module]:  # the learned parts are the wrapped policy's
        return self.policy.modules()

    def new_request(self) -> object | None:
        return self.policy.new_request()

    def reset_random(self) -> None:
        self.policy.reset_random()

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        self.policy.prefill(state, q, k, v)

    def finish_prefill(self, states: Sequence[KVState]) -> None:
        self.policy.finish_prefill(states)

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        self.policy.append(state, k, v)


__all__ = ["PolicyWrapper"]
