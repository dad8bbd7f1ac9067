"""The one registry of KV policies: spec name -> class.

Specs (`policyzoo.spec`: ``--kv quest:0.1``), files that name a wrapped policy (`PrHS.save`) and the
contract tests all read this dict. A policy of your own joins in one line, before it is named in a
spec or loaded from a file::

    from policyzoo.kv.registry import KV_POLICIES, register
    KV_POLICIES["mine"] = MyPolicy        # a KVSelector dataclass: its fields are its spec parameters
    @register("mine")                     # or, where the class is defined
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .base import KVSelector

P = TypeVar("P", bound=type)

# Filled as the policy modules are imported (`policyzoo.kv` imports every built-in one).
KV_POLICIES: dict[str, type[KVSelector]] = {}


def register(name: str) -> Callable[[P], P]:
    """Class decorator: ``@register("quest")`` puts the policy in `KV_POLICIES` under ``name``."""

    def add(cls: P) -> P:
        if name in KV_POLICIES and KV_POLICIES[name] is not cls:
            raise ValueError(f"a KV policy is already registered as {name!r}: {KV_POLICIES[name].__name__}")
        KV_POLICIES[name] = cls
        return cls

    return add


def policy_class(class_name: str) -> type[KVSelector]:
    """The registered policy class called ``class_name`` (as a file records it)."""
    for cls in KV_POLICIES.values():
        if cls.__name__ == class_name:
            return cls
    raise ValueError(f"a {class_name} policy is not registered: register it before loading "
                     f"(policyzoo.kv.registry.KV_POLICIES['name'] = {class_name}); registered: "
                     f"{', '.join(cls.__name__ for cls in KV_POLICIES.values())}")


__all__ = ["KV_POLICIES", "policy_class", "register"]
