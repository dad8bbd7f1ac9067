"""Scores a policy ranks by, on one layer's `KVState`: exact scores, the page bounds (box and key
sketch) and their GQA aggregation, the pages and tokens a policy always keeps (sinks and the recent
window), and a page policy's budget in pages.

Everything here works on tensors of static shape and never synchronises with the host.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .. import kernels
from ..cache import SKETCH
from .base import Aggregate, Budget, KVState


# ------------------------------------------------------------------------------------ scorers
def exact_scores(state: KVState, q: Tensor) -> Tensor:
    """``float32[B, H, N]``: exact ``scale·q·k`` for every cache slot (reads all keys)."""
    b, h, d = q.shape
    keys = state.keys
    qg = q.to(keys.dtype).view(b, keys.shape[1], h // keys.shape[1], d)
    # In the cache's dtype (matmuls accumulate in fp32): upcasting the keys first would write and
    # re-read a float copy of the whole cache every step.
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * state.scale
    return s.reshape(b, h, -1)


PageBound = Literal["box", "sketch"]
PAGE_BOUNDS = ("box", "sketch")


def check_page_bound(value: object) -> None:
    """A page policy's ``bound``: ``"box"`` (Quest's min/max) or ``"sketch"`` (the 4-bit key sketch)."""
    if value not in PAGE_BOUNDS:
        raise ValueError(f"bound must be one of {PAGE_BOUNDS}, got {value!r}")


def bound_summaries(bound: PageBound) -> tuple[str, ...]:
    """The cache summaries a page bound of kind ``bound`` reads."""
    return ("page_min", "page_max", SKETCH) if bound == "sketch" else ("page_min", "page_max")


def page_bound_scores(state: KVState, q: Tensor, bound: PageBound = "box") -> Tensor:
    """``float32[B, H, P]``: an upper bound of ``scale·q·k`` per page and query head.

    ``"box"``: Quest's ``Σ_d max(q_d·min_d, q_d·max_d)`` from the page min/max, which overshoots a
    page's best key by many nats on real models (13 on SmolLM2, pages of 16). ``"sketch"``: the best
    per-token bound of the page from the 4-bit key sketch (`kernels.sketch_page_bound`), about a nat
    over; ``-inf`` on pages without visible tokens."""
    c = state.cache
    if bound == "sketch":
        return kernels.sketch_page_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer],
                                         c.start, c.length, state.scale)
    return kernels.quest_page_bound(q, c.page_min[state.layer], c.page_max[state.layer], state.scale)


def group_page_bounds(state: KVState, q: Tensor, bound: PageBound = "box") -> Tensor:
    """``float32[B, H_kv, P]``: the largest page bound over each GQA group's query heads, ``-inf`` on
    pages without visible tokens. Equal to ``aggregate_groups(page_bound_scores(...), ..., "max")``,
    but the kernel folds the group itself, so the per-head bounds ``[B, H, P]`` are never written."""
    c = state.cache
    if bound == "sketch":
        return kernels.sketch_page_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer],
                                         c.start, c.length, state.scale, "max")
    out = kernels.quest_page_bound_grouped(q, c.page_min[state.layer], c.page_max[state.layer], state.scale, "max")
    return out.masked_fill(~state.page_valid()[:, None, :], -torch.inf)


def token_bound_scores(state: KVState, q: Tensor) -> Tensor:
    """``float32[B, H, N]``: an upper bound of ``scale·q·k_t`` for every cache slot from the key
    sketch (`reference.sketch_token_bound`), ``-inf`` where the slot is not visible. Reads the sketch
    of the whole cache: for certificates and audits, not for a fast selection."""
    c = state.cache
    tb = kernels.reference.sketch_token_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer], state.scale)
    return tb.masked_fill(~state.token_valid()[:, None, :], -torch.inf)


def aggregate_groups(scores: Tensor, valid: Tensor, num_kv_heads: int, how: Aggregate) -> Tensor:
    """Fold per-query-head logits ``[B, H, N]`` into one score per KV head ``[B, H_kv, N]``.

    ``"max"`` keeps the largest logit of the group; ``"sum"`` sums the group's softmax
    probabilities (the selection then maximises the group's kept mass). Invalid entries are -inf.
    """
    b, h, n = scores.shape
    s = scores.view(b, num_kv_heads, h // num_kv_heads, n).masked_fill(~valid[:, None, None, :], -torch.inf)
    if how == "max":
        out = s.amax(2)
    elif how == "sum":
        out = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(2)
    else:
        raise ValueError(f"aggregate must be 'sum' or 'max', got {how!r}")
    return out.masked_fill(~valid[:, None, :], -torch.inf)


# ------------------------------------------------------------------------------ sinks, window
def forced_tokens(state: KVState, sinks: int, window: int) -> Tensor:
    """``bool[B, N]``: the first ``sinks`` and the last ``window`` visible tokens of each row."""
    pos = torch.arange(state.cache.capacity, device=state.keys.device)
    return forced_at(state, pos.expand(state.cache.batch, -1), sinks, window)


def forced_at(state: KVState, slots: Tensor, sinks: int, window: int) -> Tensor:
    """`forced_tokens` at ``slots int64[B, ...]`` only (the same shape): the flags of a few slots
    without building, or gathering from, a tensor the size of the cache."""
    shape = (slots.shape[0],) + (1,) * (slots.dim() - 1)
    start, length = state.cache.start.view(shape), state.cache.length.reshape(-1, *shape[1:])
    return state.cache.visible_at(slots) & ((slots < start + sinks) | (slots >= length - window))


def forced_pages(state: KVState, sinks: int, window: int) -> Tensor:
    """``bool[B, P]``: pages holding any forced token (the last page is always forced).

    Computed in page space (the visible slot range of each page against the sink and window
    ranges), not by folding `forced_tokens` over the whole capacity: a step then touches P
    entries, not P·page.
    """
    c = state.cache
    first, last = c.page_spans()
    holds_sink = first < c.start[:, None] + sinks
    holds_window = last > c.length - max(window, 1)
    return (first < last) & (holds_sink | holds_window)


def page_budget(state: KVState, budget: Budget, page: int, sinks: int, window: int, owner: str) -> tuple[int, Tensor]:
    """``(k_max, count)`` in pages for a page policy: ``budget`` tokens become ``ceil(budget / page)``
    pages, a ratio applies to the visible pages; ``k_max`` always has room for the forced pages."""
    k_max = page_k_max(state, budget, page, sinks, window, owner)
    n_visible = state.page_valid().sum(-1)
    count = budget.count(n_visible) if budget.is_ratio else Budget(math.ceil(budget.value / page)).count(n_visible)
    return k_max, count


def page_k_max(state: KVState, budget: Budget, page: int, sinks: int, window: int, owner: str) -> int:
    """`page_budget`'s static width alone (its count is then the policy's `Budget`, `page_count_rule`)."""
    if state.page_size != page:
        raise ValueError(f"{owner}(page={page}) needs a cache with page_size={page}, got {state.page_size}")
    n_pages = state.cache.num_pages
    k_max = budget.k_max(n_pages) if budget.is_ratio else min(n_pages, math.ceil(budget.value / page))
    # Sinks and window may each straddle one more page than their length needs.
    n_forced = math.ceil(sinks / page) + math.ceil(max(window, 1) / page) + 2
    return max(k_max, min(n_pages, n_forced))


def page_count_rule(budget: Budget, page: int) -> tuple[float, int]:
    """`page_budget`'s count as the rule a fused selection evaluates on the device
    (`kernels.select_pages`): ``(ratio, 0)`` for a keep ratio of the visible pages, else
    ``(0.0, ceil(budget / page))`` pages."""
    return (float(budget.value), 0) if budget.is_ratio else (0.0, math.ceil(budget.value / page))
