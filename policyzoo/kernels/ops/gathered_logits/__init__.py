"""Exact logits of gathered keys (a two-stage policy's second stage): the op
``policyzoo::gathered_logits``.

Specification: ``reference.py``; kernel: ``kernel.py``. Launch parameters: `GatheredLogitsConfig`,
completed per call by `gathered_logits_config`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch
from torch import Tensor

from ...config import LaunchConfig, current, next_power_of_2, one_of, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatheredLogitsConfig(LaunchConfig):
    """Launch parameters of the exact logits of gathered keys."""

    keyword = "gathered_logits"
    METHODS: ClassVar[tuple[str, ...]] = ("dot", "loop")

    method: str = "dot"
    """``"dot"``: the G query heads against a tile of keys with tl.dot (head dims under 16 take the
    loop); ``"loop"``: the heads in turn over the tile held in registers."""
    block_t: int = 64
    """Slots (key rows) per program (16 at least with tl.dot)."""
    num_warps: int = 4
    """Warps per program."""

    def __post_init__(self) -> None:
        one_of(self, "method", self.METHODS)
        powers_of_two(self, "block_t", "num_warps")


def gathered_logits_config(d: int) -> GatheredLogitsConfig:
    """The launch parameters of a call with head dim ``d``: the config in force (`config.current`),
    with the loop where tl.dot cannot serve (head dims under 16) and tiles of 16 slots at least for
    the dot."""
    return _choose(current(GatheredLogitsConfig), d)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: GatheredLogitsConfig, d: int) -> GatheredLogitsConfig:
    if cfg.method == "dot" and next_power_of_2(d) >= 16:
        return dataclasses.replace(cfg, block_t=max(16, cfg.block_t))
    return dataclasses.replace(cfg, method="loop")


@torch.library.custom_op("policyzoo::gathered_logits", mutates_args=())
def _gathered_logits_op(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str = "none") -> Tensor:
    need_triton()
    return kernel.gathered_logits(q, keys, slots, scale, agg, gathered_logits_config(q.shape[-1]))


@_gathered_logits_op.register_fake
def _(q, keys, slots, scale, agg="none"):
    b, h, _ = q.shape
    h_kv = keys.shape[1]
    return q.new_empty(b, h_kv, *((h // h_kv,) if agg == "none" else ()), slots.shape[-1], dtype=torch.float32)


@routed(reference.gathered_logits)
def gathered_logits(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str = "none") -> Tensor:
    """Exact ``scale·q·k`` of each query head against the keys at ``slots`` → ``float32[B, H_kv, G,
    N]``, or the group's max ``[B, H_kv, N]`` with ``agg="max"`` (a two-stage policy's candidates);
    see `reference.gathered_logits`."""
    if agg not in ("none", "max"):  # before the op: a bad value fails here, not in a compiled graph
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    return torch.ops.policyzoo.gathered_logits(q, keys, slots, float(scale), agg)


__all__ = ["GatheredLogitsConfig", "gathered_logits", "gathered_logits_config"]
