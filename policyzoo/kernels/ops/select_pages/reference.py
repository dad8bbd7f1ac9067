"""The fused selection's specification, in plain torch: the steps a page policy took before the
fused kernels (the grouped box bound, visibility, forced pages, the bf16 ranking, `select_top`),
composed as they were."""

from __future__ import annotations

import torch
from torch import Tensor

from ..quest_page_bound.reference import quest_page_bound_grouped
from ..select_top.reference import select_top


def round_for_ranking(scores: Tensor) -> Tensor:
    """``float32`` scores rounded to 8 significant bits (bf16 precision, to nearest), ``±inf`` kept.

    Done on the bits with integer ops: a cast to bf16 and back is no rounding under torch.compile,
    which keeps fused intermediates in fp32.
    """
    bits = scores.float().contiguous().view(torch.int32)
    return ((bits + 0x8000) & -0x10000).view(torch.float32)


def select_scores(scores: Tensor, forced: Tensor, count: Tensor, k_max: int) -> tuple[Tensor, Tensor]:
    """Keep the forced entries plus the best-scoring others, at most ``count`` per row →
    ``(indices int32[B, H_kv, k_max], kept int32[B, H_kv])``, the indices ascending, zeros after
    ``kept``.

    ``scores [B, H_kv, N]`` (``-inf`` where the entry is invalid; NaN is invalid too), ``forced
    bool[B, N]`` or ``[B, H_kv, N]`` (forced entries outrank every score), ``count int[B]`` or
    ``[B, H_kv]``: raised to the number of forced valid entries, capped at ``k_max`` and at the
    number of valid entries.

    Scores are ranked at bf16 precision (`round_for_ranking`), and ties go to the lowest position
    (`select_top`)."""
    b, h_kv, n = scores.shape
    valid = scores > -torch.inf
    forced = (forced if forced.dim() == 3 else forced[:, None, :]) & valid
    ranked = round_for_ranking(torch.where(forced, torch.inf, scores))
    n_forced = forced.sum(-1)
    n_valid = valid.sum(-1)
    want = torch.maximum(count if count.dim() == 2 else count[:, None], n_forced).clamp(max=k_max)
    kept = torch.minimum(want, n_valid).int()
    idx = select_top(ranked.reshape(b * h_kv, n), kept.reshape(-1), k_max)
    return idx.view(b, h_kv, k_max), kept


def visible_pages(start: Tensor, length: Tensor, page_size: int, n_pages: int) -> tuple[Tensor, Tensor]:
    """``(first, last) int64[B, P]``: page ``p`` of row ``b`` holds visible slots ``first .. last-1``
    (none when ``first >= last``); row ``b`` sees slots ``start[b] .. length-1``."""
    lo = torch.arange(n_pages, device=start.device) * page_size
    first = torch.maximum(lo, start[:, None])
    last = torch.minimum(lo + page_size, length.reshape(-1)[:1].expand(start.shape[0])[:, None])
    return first, last


def page_count(n_visible: Tensor, ratio: float, pages: int) -> Tensor:
    """``int64[B]``: pages a page policy wants from ``n_visible`` visible pages: ``ceil(ratio ·
    n_visible)`` for a keep ratio (``ratio > 0``; the epsilon absorbs float error, as `kv.Budget`),
    else ``pages``."""
    if ratio > 0:
        return torch.ceil(n_visible.double() * ratio - 1e-9).long()
    return torch.full_like(n_visible, pages)


def page_flags(ids: Tensor, start: Tensor, length: Tensor, page_size: int, sinks: int, window: int) -> tuple[Tensor, Tensor]:
    """``(seen, forced) bool``, shaped as the page ids ``ids int[B, ...]`` (``-1``: no page): a page
    is seen when it holds a visible slot of its row (`visible_pages`), forced when it also holds one
    of the row's first ``sinks`` or last ``max(window, 1)`` visible slots (the last page always)."""
    shape = (ids.shape[0],) + (1,) * (ids.dim() - 1)
    lo = ids.long() * page_size
    start, length = start.view(shape), length.reshape(-1)[:1].view((1,) * ids.dim())
    first, last = torch.maximum(lo, start), torch.minimum(lo + page_size, length)
    seen = (ids >= 0) & (first < last)
    return seen, seen & ((first < start + sinks) | (last > length - max(window, 1)))


def page_choice_inputs(
    scores: Tensor, start: Tensor, length: Tensor, count: Tensor | None = None, page_size: int = 16, sinks: int = 0,
    window: int = 0, ratio: float = 0.0, pages: int = 0, ids: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(scores, forced, count)`` for `select_scores` from given page ``scores [B, H_kv, N]``: the
    scores ``-inf`` on entries whose page holds no visible slot, the flags of `page_flags`, and
    ``count`` or, without it (and without ``ids``), `page_count` of the visible pages. The entries are
    the pages ``0 .. N-1``, or with ``ids int[B, H_kv, N]`` the page ids listed (``-1``: none)."""
    b, h_kv, n = scores.shape
    if ids is None:
        ids = torch.arange(n, device=scores.device).expand(b, n)
    elif count is None:
        raise ValueError("select_page_scores over listed page ids needs a count: the keep ratio counts a row's pages")
    seen, forced = page_flags(ids, start, length, page_size, sinks, window)
    if count is None:
        count = page_count(seen.sum(-1), ratio, pages)
    seen = seen if seen.dim() == 3 else seen[:, None, :]
    return scores.masked_fill(~seen, -torch.inf), forced, count


def select_page_scores(
    scores: Tensor, start: Tensor, length: Tensor, k_max: int, count: Tensor | None = None, page_size: int = 16,
    sinks: int = 0, window: int = 0, ratio: float = 0.0, pages: int = 0, ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A page policy's choice from its given page ``scores [B, H_kv, N]`` → ``(indices
    int32[B, H_kv, k_max], kept int32[B, H_kv])``, positions in ``scores`` ascending, zeros after
    ``kept``: `select_scores` of `page_choice_inputs` (the visibility, the forced pages of
    `page_flags` and the budget).

    The entries are the pages ``0 .. N-1``, or with ``ids int[B, H_kv, N]`` the page ids listed
    (``-1``: an empty entry; a second stage's candidates). Entries on pages without a visible slot
    are invalid. ``count`` (``int[B]`` or ``[B, H_kv]``), or without it (and without ``ids``)
    `page_count` of the visible pages (``ratio`` or ``pages``)."""
    masked, forced, count = page_choice_inputs(scores, start, length, count, page_size, sinks, window, ratio, pages, ids)
    return select_scores(masked, forced, count, k_max)


def select_pages(
    q: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float, k_max: int,
    count: Tensor | None = None, page_size: int = 16, sinks: int = 0, window: int = 0, ratio: float = 0.0,
    pages: int = 0,
) -> tuple[Tensor, Tensor]:
    """`Quest`'s page choice with the box bound folded by the group's max → ``(indices
    int32[B, H_kv, k_max], kept int32[B, H_kv])``: page ids ascending, zeros after ``kept``.

    The bound `quest_page_bound_grouped` (``agg="max"``), then `select_page_scores` with ``count``
    (``int[B]`` or ``[B, H_kv]``), or without it `page_count` of the visible pages (``ratio`` or
    ``pages``)."""
    scores = quest_page_bound_grouped(q, page_min, page_max, scale, "max")
    return select_page_scores(scores, start, length, k_max, count, page_size, sinks, window, ratio, pages)
