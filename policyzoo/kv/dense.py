"""`Dense`: every page selected. Dense decoding runs through the same attention kernel as the
sparse policies, so dense and sparse timings compare like with like (the ByteCross fairness rule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..selection import Selection
from .base import KVSelector, KVState
from .registry import register


@register("dense")
@dataclass
class Dense(KVSelector):
    """Attend to the whole visible context: every page holding a visible token."""

    summaries = ()  # reads no summary: a dense decode step refreshes none
    layer_invariant = True

    @property
    def same_every_layer(self) -> bool:  # type: ignore[override]
        # Its select reads the cache's geometry alone; a subclass with a select of its own says for itself.
        return type(self).select is Dense.select

    def select(self, state: KVState, q: Tensor) -> Selection:
        cache = state.cache
        b, h_kv = q.shape[0], state.keys.shape[1]
        pages = torch.arange(cache.num_pages, device=q.device)
        used = torch.div(cache.length + cache.page_size - 1, cache.page_size, rounding_mode="floor")
        # Each row starts at the page of its first real token: pages of left padding only are skipped.
        first = torch.div(cache.start, cache.page_size, rounding_mode="floor")  # [B]
        indices = (first[:, None] + pages).clamp(max=cache.num_pages - 1)
        return Selection(
            indices=indices.int()[:, None, :].expand(b, h_kv, -1),
            count=(used - first).clamp(min=0).int()[:, None].expand(b, h_kv),
            block=cache.page_size,
        )
