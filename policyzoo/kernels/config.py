"""Launch configurations of the Triton kernels, as values, and a scoped override.

Each op keeps its launch parameters in one frozen dataclass of its own, a `LaunchConfig` that names its
``keyword`` in `override` (`known_kernels`), beside its shape rule, which completes the config in force
for a call: fields that leave the choice to the shapes (a 0, ``method="auto"``) are chosen, and a
choice the call cannot take is adapted (no tl.dot for head dims under 16, for instance). Every other
field is used as it is.

The config in force is the dataclass's defaults, or, inside ``with override(...)``, the config the
innermost override gives for that kernel::

    with kernels.config.override(attention=AttentionConfig(block_t=128)):
        ...  # every decode-attention launch here uses tiles of 128 tokens, the other defaults

An override replaces the kernel's config as a whole: fields it does not set take the dataclass
defaults, not an outer override's values (start from ``dataclasses.replace(current(K), ...)`` to
keep those). It is a `contextvars` variable: scopes nest (an inner override replaces the configs
it names and keeps the outer ones for the other kernels), the configs before the scope come back
when it exits, by an exception too, and other threads (and asyncio tasks) keep their own.

A config is read when a kernel launches, inside the custom op: a CUDA graph replays the launches it
captured, whatever is in force at replay. This module imports no triton and knows no op, so configs
can be made, checked and recorded anywhere.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import ClassVar, TypeVar


class LaunchConfig:
    """Base of the ops' launch configs: frozen, keyword-only dataclasses, each naming its kernel's
    keyword in `override` (``keyword``)."""

    keyword: ClassVar[str]


C = TypeVar("C", bound=LaunchConfig)


def known_kernels() -> Mapping[str, type[LaunchConfig]]:
    """The config class of each kernel, by its keyword in `override` (and in the sweep's records)."""
    return MappingProxyType({kind.keyword: kind for kind in LaunchConfig.__subclasses__()})


# ------------------------------------------------------------------------------------ validators
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(cfg: object, names: tuple[str, ...], ok, what: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (_is_int(value) and ok(value)):
            raise ValueError(f"{type(cfg).__name__}.{name} must be {what}, got {value!r}")


def positive(cfg: object, *names: str) -> None:
    _require(cfg, names, lambda v: v > 0, "a positive int")


def non_negative(cfg: object, *names: str) -> None:
    _require(cfg, names, lambda v: v >= 0, "an int >= 0")


def powers_of_two(cfg: object, *names: str, zero: bool = False) -> None:
    """Triton's block sizes (``tl.arange``) and warp counts are powers of two; ``zero`` also allows
    0, which leaves the choice to the shape rule."""
    _require(cfg, names, lambda v: (zero and v == 0) or (v > 0 and v & (v - 1) == 0),
             "a power of two" + (" or 0" if zero else ""))


def one_of(cfg: object, name: str, known: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in known:
        raise ValueError(f"{type(cfg).__name__}.{name} must be one of {known}, got {value!r}")


def booleans(cfg: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{type(cfg).__name__}.{name} must be a bool, got {getattr(cfg, name)!r}")


def at_least(cfg: object, least: int, why: str, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < least:
            raise ValueError(f"{type(cfg).__name__}.{name} must be {least} at least ({why}), got {getattr(cfg, name)}")


# ------------------------------------------------------------------------- shape arithmetic
# The shape rules' integer helpers, as triton's (`triton.cdiv`, `triton.next_power_of_2`), so that the
# rules run without triton.
def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# ------------------------------------------------------------------------------------ the scope
_OVERRIDES: contextvars.ContextVar[Mapping[type, LaunchConfig]] = contextvars.ContextVar(
    "policyzoo_kernel_overrides", default=MappingProxyType({})
)


@functools.cache  # a config class's defaults: a frozen value
def _defaults(kind: type[C]) -> C:
    return kind()


@contextmanager
def override(**configs: LaunchConfig) -> Iterator[None]:
    """Launch the named kernels with these configs inside the ``with`` block (keywords:
    `known_kernels`), e.g. ``override(attention=AttentionConfig(block_t=128),
    select_top=SelectTopConfig(method="program"))``.

    Each config replaces that kernel's config as given (see the module docstring); its fields that
    leave a choice to the shapes are still filled in per call by the kernel's shape rule."""
    kernels = known_kernels()
    for name, cfg in configs.items():
        kind = kernels.get(name)
        if kind is None:
            raise TypeError(f"override() got an unknown kernel {name!r}; known: {', '.join(kernels)}")
        if type(cfg) is not kind:
            raise TypeError(f"override({name}=...) takes a {kind.__name__}, got {type(cfg).__name__}")
    merged = {**_OVERRIDES.get(), **{type(cfg): cfg for cfg in configs.values()}}
    token = _OVERRIDES.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def current(kind: type[C]) -> C:
    """The config in force for the kernel of config class ``kind``: the innermost override's, else
    the defaults, ``kind()``."""
    return _OVERRIDES.get().get(kind) or _defaults(kind)


def parse_overrides(specs: Iterable[str]) -> dict[str, LaunchConfig]:
    """`override`'s keywords from ``kernel.field=value`` strings (a command line's), e.g.
    ``["select_pages.finish_min_row=0", "attention.block_t=32"]`` → ``{"select_pages":
    SelectPagesConfig(finish_min_row=0), "attention": AttentionConfig(block_t=32)}``: each kernel's
    defaults with the fields named. A value is read as its field's type (int, float, a bool as
    true/false, a string as it is). An unknown kernel or field, or a value its config refuses,
    raises ValueError."""
    kernels = known_kernels()
    fields: dict[str, dict[str, object]] = {}
    for spec in specs:
        name, dot, rest = spec.partition(".")
        field, eq, text = rest.partition("=")
        if not (dot and eq and field):
            raise ValueError(f"expected kernel.field=value, got {spec!r}")
        kind = kernels.get(name)
        if kind is None:
            raise ValueError(f"unknown kernel {name!r} in {spec!r}; known: {', '.join(sorted(kernels))}")
        known = {f.name for f in dataclasses.fields(kind)}
        if field not in known:
            raise ValueError(f"{kind.__name__} has no field {field!r}; its fields: {', '.join(sorted(known))}")
        fields.setdefault(name, {})[field] = _parse_value(text, getattr(_defaults(kind), field), spec)
    return {name: dataclasses.replace(_defaults(kernels[name]), **values) for name, values in fields.items()}


def _parse_value(text: str, default: object, spec: str) -> object:
    """``text`` as the type of the field's ``default``."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        what = {bool: "true or false", int: "an int", float: "a float"}[type(default)]
        raise ValueError(f"{spec!r}: expected {what}, got {text!r}") from None
    return text


def active() -> dict[str, LaunchConfig]:
    """The overrides in force, by kernel (`known_kernels`); kernels at their defaults are left out."""
    overrides = _OVERRIDES.get()
    return {name: overrides[kind] for name, kind in known_kernels().items() if kind in overrides}


__all__ = ["LaunchConfig", "known_kernels", "override", "current", "active", "parse_overrides"]
