"""`Window`: attention sinks plus the most recent tokens (StreamingLLM-style).

The baseline every selection policy should beat: cheap and stable, but blind to anything in the
middle of the context, so it misses needles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..selection import Selection
from .base import KVSelector, KVState, check_count
from .choose import choose_topk
from .scoring import forced_tokens
from .registry import register


@register("window")
@dataclass
class Window(KVSelector):
    """Keep the first ``sinks`` and the last ``window`` tokens of every row."""

    sinks: int = 4
    window: int = 256
    summaries = ()
    layer_invariant = True

    @property
    def same_every_layer(self) -> bool:  # type: ignore[override]
        # Its select reads the cache's geometry alone; a subclass with a select of its own says for itself.
        return type(self).select is Window.select

    def __post_init__(self) -> None:
        check_count(self.sinks, "sinks")
        check_count(self.window, "window", minimum=1)

    def select(self, state: KVState, q: Tensor) -> Selection:
        forced = forced_tokens(state, self.sinks, self.window)
        b, h_kv = q.shape[0], state.keys.shape[1]
        scores = torch.where(forced, 0.0, -torch.inf)[:, None, :].expand(b, h_kv, -1)
        k_max = min(self.sinks + self.window, state.cache.capacity)
        return choose_topk(scores, forced, k_max, torch.zeros(b, dtype=torch.long, device=q.device), workspace=state.workspace)
