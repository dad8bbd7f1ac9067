"""`AttentionTopK`: attention-scored selection (the KV branch of the ByteCross paper).

Scores every key exactly (``q·k``, which reads all keys: an oracle-like reference for the cheaper
policies, not a bandwidth saver by itself), folds the GQA group's softmax mass into one score per KV
head and keeps the top entries plus sinks and the local window.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..selection import Selection
from .base import Aggregate, Budget, KVSelector, KVState, check_count
from .choose import choose_topk
from .scoring import aggregate_groups, exact_scores, forced_tokens
from .registry import register


@register("attn-topk")
@dataclass
class AttentionTopK(KVSelector):
    """Keep ``budget`` tokens (an int) or a ``budget`` fraction of the context (a float in (0, 1]).

    The budget counts sinks and window; ``aggregate`` folds the query heads of a GQA group
    (``"sum"`` of softmax mass, or ``"max"`` logit).
    """

    budget: int | float = 0.25
    sinks: int = 4
    window: int = 32
    aggregate: Aggregate = "sum"
    summaries = ()  # exact scores read the keys themselves
    layer_invariant = True

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        if not self._budget.is_ratio and self.sinks + self.window > self.budget:
            raise ValueError(f"budget ({self.budget}) must cover sinks + window ({self.sinks + self.window})")
        if self.aggregate not in ("sum", "max"):
            raise ValueError(f"aggregate must be 'sum' or 'max', got {self.aggregate!r}")

    def select(self, state: KVState, q: Tensor) -> Selection:
        valid = state.token_valid()
        scores = aggregate_groups(exact_scores(state, q), valid, state.keys.shape[1], self.aggregate)
        forced = forced_tokens(state, self.sinks, self.window)
        k_max = max(self._budget.k_max(state.cache.capacity), min(self.sinks + self.window, state.cache.capacity))
        return choose_topk(scores, forced, k_max, self._budget.count(state.num_valid()), workspace=state.workspace)
