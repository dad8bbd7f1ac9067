"""`CommunityKV`'s choice of communities: the op ``policyzoo::community_choice``, the tokens of the
best-scored communities within a budget, then the forced ones.

Specification: ``reference.py`` (a sort of every community); kernel: ``kernel.py``, a weighted
threshold of the communities' 16-bit score keys in four launches, group mode only (one unit per KV
head; head mode, where a token can lie in several communities of a head and counts once, goes to
the reference). The histograms need a zeroed buffer: the caller's `Workspace` (``workspace=``), else
one made for the call. Launch parameters: `CommunityChoiceConfig`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...config import LaunchConfig, current, powers_of_two
from ...route import HAS_TRITON, check_device, need_triton, routed
from ...workspace import Workspace, buffer, zeroed
from . import reference

if HAS_TRITON:
    from . import kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommunityChoiceConfig(LaunchConfig):
    """Launch parameters of `community_choice`."""

    keyword = "community_choice"
    chunk: int = 512
    """Communities per program (every launch)."""
    width: int = 4
    """Entries of each community's range read at once (a part of ``split=4`` has up to 4 tokens)."""
    num_warps: int = 4

    def __post_init__(self) -> None:
        powers_of_two(self, "chunk", "width", "num_warps")


def takes(scores: Tensor, size: Tensor, room: Tensor, offset: Tensor, order: Tensor, start: Tensor, length: Tensor,
          free: Tensor, k_max: int, heads: int, *args, **kwargs) -> bool:
    """Whether the kernel takes the call: group mode (one unit per KV head) and ids that fit 31 bits."""
    return size.shape[1] == heads and size.shape[2] < 2**31


@torch.library.custom_op("policyzoo::community_choice", mutates_args=())
def _community_choice_op(
    scores: Tensor, size: Tensor, room: Tensor, offset: Tensor, order: Tensor, start: Tensor, length: Tensor,
    free: Tensor, k_max: int, sinks: int, window: int, top: int, histograms: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # ``histograms`` is written and left zero: to torch the op does not mutate it.
    need_triton()
    check_device(scores)
    b, heads, m = size.shape
    if any(t.shape != size.shape for t in (scores, room, offset)) or order.shape[:2] != (b, heads):
        raise ValueError(f"expected scores, size, room, offset [B, H_kv, C] and order [B, H_kv, W], got "
                         f"{tuple(scores.shape)}, {tuple(size.shape)}, {tuple(room.shape)}, {tuple(offset.shape)} and "
                         f"{tuple(order.shape)}")
    hist = zeroed(histograms, b * heads * kernel.HIST, scores.device)
    return kernel.community_choice(scores, size, room, offset, order, start, length, free, k_max, sinks, window, top,
                                   hist, current(CommunityChoiceConfig))


@_community_choice_op.register_fake
def _(scores, size, room, offset, order, start, length, free, k_max, sinks, window, top, histograms=None):
    b, heads, m = size.shape
    return (scores.new_empty(b, heads, k_max, dtype=torch.int32), scores.new_empty(b, heads, dtype=torch.int32),
            scores.new_empty(b, heads, min(top, m), dtype=torch.int64), scores.new_empty(b, heads, 1, dtype=torch.int64))


@routed(reference.community_choice, takes=takes)
def community_choice(
    scores: Tensor, size: Tensor, room: Tensor, offset: Tensor, order: Tensor, start: Tensor, length: Tensor,
    free: Tensor, k_max: int, heads: int, sinks: int, window: int, top: int, capacity: int, *,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The tokens of each KV head's best-scored communities, ``free[b]`` of them, then the forced ones
    → ``(indices int32[B, H_kv, k_max], count int32[B, H_kv], best int64[B, U, min(top, C)],
    roomiest int64[B, U, 1])``; see `reference.community_choice` (the kept slots' order is not part
    of it). ``workspace``: the zeroed histograms (`Workspace`)."""
    return torch.ops.policyzoo.community_choice(
        scores, size, room, offset, order, start, length, free, int(k_max), min(int(sinks), capacity),
        min(int(window), capacity), int(top), buffer(workspace, "select_histograms"))


__all__ = ["CommunityChoiceConfig", "community_choice", "takes"]
