"""`Quest`: query-aware page selection from per-page key min/max summaries (Tang et al., 2024).

The page bound ``Σ_d max(q_d·min_d, q_d·max_d)`` is an upper bound of ``q·k`` for every key of the
page, computed from the cache's summaries without reading the keys; the top pages are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from ..selection import Selection
from .base import Aggregate, Budget, KVSelector, KVState, aggregate_groups, check_count, choose_topk, forced_pages, page_bound_scores


@dataclass
class Quest(KVSelector):
    """Keep ``ceil(budget / page)`` pages (``budget`` in tokens, or a keep ratio of the context).

    ``page`` is the cache page size this policy needs; ``sinks`` and ``window`` (tokens) force the
    pages that hold them; the last page is always kept.
    """

    budget: int | float = 0.25
    page: int = 16
    sinks: int = 4
    window: int = 16
    aggregate: Aggregate = "max"

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        check_count(self.page, "page", minimum=1)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        if self.aggregate not in ("sum", "max"):
            raise ValueError(f"aggregate must be 'sum' or 'max', got {self.aggregate!r}")

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.page

    def select(self, state: KVState, q: Tensor) -> Selection:
        if state.page_size != self.page:
            raise ValueError(f"Quest(page={self.page}) needs a cache with page_size={self.page}, got {state.page_size}")
        valid = state.page_valid()
        scores = aggregate_groups(page_bound_scores(state, q), valid, state.keys.shape[1], self.aggregate)
        forced = forced_pages(state, self.sinks, self.window)
        n_pages = state.cache.num_pages
        if self._budget.is_ratio:
            k_max, count = self._budget.k_max(n_pages), self._budget.count(valid.sum(-1))
        else:
            wanted = math.ceil(self.budget / self.page)
            k_max, count = min(n_pages, wanted), Budget(wanted).count(valid.sum(-1))
        # Sinks and window may each straddle one more page than their length needs.
        n_forced = math.ceil(self.sinks / self.page) + math.ceil(max(self.window, 1) / self.page) + 2
        k_max = max(k_max, min(n_pages, n_forced))
        return choose_topk(scores, forced, k_max, count, block=self.page)
