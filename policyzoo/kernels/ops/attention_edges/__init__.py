"""The attention graph's edge search: each query's most attended keys under causal attention.

A prefill-time kernel, called eagerly, so no custom op: the public function launches it directly.
Specification: ``reference.py``; kernel: ``kernel.py``. Launch parameters: `AttentionEdgesConfig`.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ...config import LaunchConfig, current, positive, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionEdgesConfig(LaunchConfig):
    """Launch parameters of the edge search: a program takes ``block_q`` queries of one head against
    tiles of ``block_k`` keys."""

    keyword = "attention_edges"

    block_q: int = 64
    """Queries per program (16 at least: tl.dot)."""
    block_k: int = 64
    """Keys per tile (16 at least: tl.dot)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 2
    """Software pipeline stages of the key loop."""

    def __post_init__(self) -> None:
        powers_of_two(self, "block_q", "block_k", "num_warps")
        positive(self, "num_stages")
        if min(self.block_q, self.block_k) < 16:
            raise ValueError(f"AttentionEdgesConfig tiles must be 16 at least (tl.dot), got {self.block_q}x{self.block_k}")


@routed(reference.attention_edges)
def attention_edges(q: Tensor, keys: Tensor, first: int, scale: float, top: int) -> tuple[Tensor, Tensor]:
    """Each query's ``top`` most attended keys under causal attention → ``(dst int32[H, T, top], p
    float32[H, T, top])``; see `reference.attention_edges`."""
    need_triton()
    return kernel.attention_edges(q, keys, first, scale, top, current(AttentionEdgesConfig))


__all__ = ["AttentionEdgesConfig", "attention_edges"]
