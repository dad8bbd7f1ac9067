"""`Quest`: query-aware page selection from per-page key min/max summaries (Tang et al., 2024).

The page bound ``Σ_d max(q_d·min_d, q_d·max_d)`` is an upper bound of ``q·k`` for every key of the
page, computed from the cache's summaries without reading the keys; the top pages are kept.

With ``rescore=r`` the bound only nominates: the top ``r`` times as many pages are candidates, their
keys are scored exactly, and the best tokens are kept, the same number of tokens as the pages would
hold (`kv.choose.rescore_pages`). The bound of a page of 16 overshoots its best key by many nats on real
models (13 on SmolLM2), so it ranks pages poorly; exact scores over a few times the budget find what
the bound misses, at the cost of reading the candidates' keys.

With ``bound="sketch"`` the pages are ranked by a bound from a 4-bit copy of every key on its page's
min/max grid (`kv.scoring.page_bound_scores`): about one nat over the page's best key instead of 13, for
an eighth of the KV bytes read to choose. The same sketch makes the certified dropped mass
(`kv.certified`) informative.

With ``bound="sketch", nominate=f`` the selection has two levels: the box bound nominates ``f`` times
the budget's pages, and the sketch ranks those candidates alone (`kv.choose.nominate_pages`), so the
step reads the box summaries and the candidates' codes, not the sketch of the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..selection import Selection
from .base import Aggregate, Budget, KVSelector, KVState, check_count
from .choose import check_rescore, choose_pages
from .scoring import (
    PageBound,
    aggregate_groups,
    bound_summaries,
    check_page_bound,
    group_page_bounds,
    page_bound_scores,
    page_k_max,
)
from .registry import register


@register("quest")
@dataclass
class Quest(KVSelector):
    """Keep ``ceil(budget / page)`` pages (``budget`` in tokens, or a keep ratio of the context).

    ``page`` is the cache page size this policy needs; ``sinks`` and ``window`` (tokens) force the
    pages that hold them; the last page is always kept. ``rescore`` > 0 (at least 1) makes it a
    two-stage selection: ``rescore`` times the pages as candidates, then the best tokens by exact
    score (a token selection of the same token budget). ``bound`` is the page bound that ranks the
    pages: ``"box"`` (the page min/max) or ``"sketch"`` (the 4-bit key sketch; tighter, and it reads
    half a byte per key channel more). ``nominate`` >= 1 (with ``bound="sketch"`` and
    ``aggregate="max"``) lets the box nominate that many times the pages and the sketch rank only
    those: the sketch's ranking for the candidates' codes alone.
    """

    budget: int | float = 0.25
    page: int = 16
    sinks: int = 4
    window: int = 16
    aggregate: Aggregate = "max"
    rescore: float = 0.0
    bound: PageBound = "box"
    nominate: float = 0.0
    layer_invariant = True

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        check_count(self.page, "page", minimum=1)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        if self.aggregate not in ("sum", "max"):
            raise ValueError(f"aggregate must be 'sum' or 'max', got {self.aggregate!r}")
        check_rescore(self.rescore)
        check_page_bound(self.bound)
        check_rescore(self.nominate, "nominate")
        if self.nominate and (self.bound != "sketch" or self.aggregate != "max"):
            raise ValueError("Quest(nominate=...) ranks the box's candidates by the key sketch: it needs "
                             f"bound='sketch' and aggregate='max', got bound={self.bound!r}, aggregate={self.aggregate!r}")

    @property
    def summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        return bound_summaries(self.bound)

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.page

    @property
    def two_stage(self) -> bool:  # type: ignore[override]
        return bool(self.rescore)

    def select(self, state: KVState, q: Tensor) -> Selection:
        k_max = page_k_max(state, self._budget, self.page, self.sinks, self.window, "Quest")
        if self.aggregate == "sum":
            scores = aggregate_groups(page_bound_scores(state, q, self.bound), state.page_valid(), state.keys.shape[1], "sum")
        elif self.bound == "box" or self.nominate:
            scores = None  # the box bound, folded by the group's max, is scored inside the choice's launch
        else:
            scores = group_page_bounds(state, q, self.bound)
        # The sinks' and window's pages and the budget are found inside the choice, from the rows' spans.
        return choose_pages(state, q, scores, None, k_max, self._budget, rescore=self.rescore, nominate=self.nominate,
                            sinks=self.sinks, window=self.window, aggregate=self.aggregate)
