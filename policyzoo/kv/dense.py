"""`Dense`: every page selected. Dense decoding runs through the same attention kernel as the
sparse policies, so dense and sparse timings compare like with like (the ByteCross fairness rule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..selection import Selection
from .base import KVSelector, KVState


@dataclass
class Dense(KVSelector):
    """Attend to the whole visible context."""

    def select(self, state: KVState, q: Tensor) -> Selection:
        cache = state.cache
        b, h_kv = q.shape[0], state.keys.shape[1]
        pages = torch.arange(cache.num_pages, device=q.device, dtype=torch.int32)
        used = torch.div(cache.length + cache.page_size - 1, cache.page_size, rounding_mode="floor")
        return Selection(
            indices=pages.expand(b, h_kv, -1),
            count=used.int().expand(b, h_kv),
            block=cache.page_size,
        )
