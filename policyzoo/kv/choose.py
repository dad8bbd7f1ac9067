"""Choosing what a policy keeps: `choose_topk` (the forced entries plus the best-scoring others, in
one fused launch where the rows allow), and the second stages of a page policy (rescoring
candidates token by token, nominating candidates by one bound and ranking them by another).

Everything here works on tensors of static shape (a fixed ``K_max``) and never synchronises with the
host, so a compiled decode step does not recompile as the context grows.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

from .. import kernels
from ..selection import Selection
from .base import Aggregate, Budget, KVState
from .scoring import forced_at, forced_pages, group_page_bounds, page_count_rule


# ------------------------------------------------------------------------------------ chooser
def round_for_ranking(scores: Tensor) -> Tensor:
    """``float32`` scores rounded to 8 significant bits (bf16 precision, to nearest), ``±inf`` kept.

    Done on the bits with integer ops: a cast to bf16 and back is no rounding under torch.compile,
    which keeps fused intermediates in fp32 (`kernels.reference.round_for_ranking`).
    """
    return kernels.reference.round_for_ranking(scores)


def fused_rows(n: int) -> bool:
    """Whether a choice over rows of ``n`` given scores is made by the fused kernel
    (`kernels.select_scores`, up to `kernels.ops.select_pages.MAX_SCORES_ROW` entries); longer rows
    take the steps (the masks, the ranking, `select_top`)."""
    return kernels.select_scores_takes(n)


def choose_topk(scores: Tensor, forced: Tensor, k_max: int, count: Tensor, block: int = 1, *,
                workspace: kernels.Workspace | None = None) -> Selection:
    """Keep the forced entries plus the best-scoring others, at most ``count`` per row.

    Args:
        scores: ``[B, H_kv, N]``, ``-inf`` where the entry is invalid.
        forced: ``bool[B, N]`` (or ``[B, H_kv, N]``) entries always kept (they outrank every score).
        k_max: static width of the selection.
        count: entries wanted, ``int64[B]`` per row or ``[B, H_kv]`` per KV head; raised to the
            number of forced entries, capped at ``k_max`` and at the number of valid entries.
        workspace: the kernels' scratch (`KVState.workspace`); None: the kernel makes its own.

    The kept entries come in ascending position order (the reads then follow memory order). Rows of
    up to `kernels.ops.select_pages.MAX_SCORES_ROW` entries are fused (`kernels.select_scores`); longer
    ones take the steps (`choose_topk_steps`: `kernels.select_top` after the masks), with the same result.

    Scores are ranked at bf16 precision (8 significant bits), and ties go to the lowest position.
    The same score computed by a compiled and an eager step can differ in its last bits (Inductor
    sums in another order), which would break near-ties differently; rounded, they tie, so both
    paths keep the same entries. Scores that round to the same bf16 value count as equal: they differ
    by less than one bf16 step, at most 2^-7 (0.8%) of their size.
    """
    b, h_kv, n = scores.shape
    if fused_rows(n):  # the masks, counts, ranking and selection in one launch
        indices, kept = kernels.select_scores(scores, forced, count, k_max, workspace=workspace)
        return Selection(indices=indices, count=kept, block=block)
    return choose_topk_steps(scores, forced, k_max, count, block, workspace=workspace)


def choose_topk_steps(scores: Tensor, forced: Tensor, k_max: int, count: Tensor, block: int = 1, *,
                      workspace: kernels.Workspace | None = None) -> Selection:
    """`choose_topk` as the steps it is made of: the masks and counts in torch, then `select_top`
    (its histograms for long bf16 rows). The fused kernel's specification, and the path of rows
    longer than it takes."""
    b, h_kv, n = scores.shape
    valid = scores > -torch.inf
    forced = (forced if forced.dim() == 3 else forced[:, None, :]) & valid
    ranked = round_for_ranking(torch.where(forced, torch.inf, scores))
    if n > kernels.SELECT_TOP_ROW:  # too long for one program: the kernel takes it in bf16 (exact here)
        ranked = ranked.to(torch.bfloat16)
    n_forced = forced.sum(-1)
    n_valid = valid.sum(-1)
    want = torch.maximum(count if count.dim() == 2 else count[:, None], n_forced).clamp(max=k_max)
    kept = torch.minimum(want, n_valid).int()
    idx = kernels.select_top(ranked.reshape(b * h_kv, n), kept.reshape(-1), k_max, workspace=workspace)
    return Selection(indices=idx.view(b, h_kv, k_max), count=kept, block=block)


# ------------------------------------------------------------------------------- second stage
def check_rescore(value: object, name: str = "rescore") -> None:
    """A page policy's ``rescore`` (or ``nominate``): 0 (off) or a candidate factor of at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value == 0 or 1 <= value < math.inf):
        raise ValueError(f"{name} must be 0 (off) or a finite candidate factor >= 1, got {value!r}")


def candidate_budget(k_max: int, count: Tensor, factor: float, n_pages: int) -> tuple[int, Tensor]:
    """``(k_max, count)`` of the candidate pages of a two-stage selection: ``factor`` times the kept
    pages (rounded up), within the cache's pages.

    ``factor`` is taken as the nearest fraction ``p/q`` with ``q <= 64`` (exact for whole numbers and
    halves), so that the counts are integer arithmetic: Inductor's Triton code failed on the float
    ``ceil`` of an int64 count on CUDA (torch 2.11)."""
    ratio = Fraction(factor).limit_denominator(64)
    p, q = ratio.numerator, ratio.denominator
    wide = min(n_pages, -(-k_max * p // q))
    return wide, torch.div(count * p + (q - 1), q, rounding_mode="floor").clamp(max=wide)


def selection_logits(state: KVState, q: Tensor, pages: Selection, agg: str = "none") -> tuple[Tensor, Tensor, Tensor]:
    """``(logits float32[B, H_kv, G, N], slots int64[B, H_kv, N], valid bool[B, H_kv, N])``: the exact
    ``scale·q·k`` of every token of the selection ``pages`` (a second stage's candidates, or any
    token or page selection; slots in its order, ascending for a policy's; ``-inf`` where invalid),
    or with ``agg="max"`` the group's best, ``[B, H_kv, N]``. Reads the selection's keys, not its
    values."""
    slots, entry = pages.token_positions()
    slots = slots.clamp(max=state.cache.capacity - 1)
    valid = entry & state.cache.visible_at(slots)
    logits = kernels.gathered_logits(q, state.keys, slots, state.scale, agg)
    return logits.masked_fill(~(valid if agg == "max" else valid[:, :, None, :]), -torch.inf), slots, valid


def rescore_pages(
    state: KVState, q: Tensor, pages: Selection, count: Tensor, k_max: int, sinks: int, window: int,
    aggregate: Aggregate = "max",
) -> Selection:
    """Stage two of a page policy: exact logits over the tokens of its candidate ``pages``, then the
    forced tokens (sinks, window, the step's own token) and the best others, ``count`` tokens at most
    (``k_max`` wide), as a token selection.

    It reads the candidates' keys, not their values: `AttentionTopK`'s exact scores, over the
    candidates only. A page bound ranks pages by how high a key *could* score; here the tokens
    compete on how high they do. ``aggregate`` folds the GQA group as `aggregate_groups` does.
    """
    if aggregate == "max":  # the group's max inside the kernel: the per-head logits are never written
        scores, slots, valid = selection_logits(state, q, pages, "max")
    else:
        logits, slots, valid = selection_logits(state, q, pages)
        scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2).masked_fill(~valid, -torch.inf)
    # The step's own token is always kept, as a page policy always keeps the last page.
    forced = forced_at(state, slots, sinks, max(window, 1)) & valid
    chosen = choose_topk(scores, forced, min(k_max, slots.shape[-1]), count, workspace=state.workspace)
    return Selection(torch.gather(slots, 2, chosen.indices.long()).int(), chosen.count, block=1)


def page_log_mass(state: KVState, q: Tensor, bounds: Tensor, pages: Selection) -> Tensor:
    """``float32[B, H, P]``: per query head, each page's log softmax numerator ``log Σ_{t∈p} e^{z_t}``:
    exact for the candidate ``pages`` (from their keys), estimated elsewhere (``-inf`` on empty pages).

    The estimate starts from the bound ``u_p + log n_p`` (``bounds [B, H, P]``) and subtracts how far
    that bound overshot the exact value on this head's candidates (their mean). The bound alone
    overshoots by many nats on real models, so next to exact values it would outrank every
    candidate. Outside the candidates this is an estimate, not a bound: fine for ranking and for a
    sampling distribution, which any positive probabilities keep unbiased."""
    b, h, n_pages = bounds.shape
    h_kv, page = state.keys.shape[1], pages.block
    logits, _, _ = selection_logits(state, q, pages)
    exact = torch.logsumexp(logits.view(b, h_kv, h // h_kv, pages.k_max, page), dim=-1)  # [B, H_kv, G, K]
    counts = state.cache.page_counts()[:, None, :].float()  # [B, 1, P]
    mass = (bounds + counts.log()).view(b, h_kv, h // h_kv, n_pages)
    ok = pages.entry_valid()[:, :, None, :] & (exact > -torch.inf)
    ids = torch.where(ok, pages.indices.long()[:, :, None, :], n_pages)  # invalid entries land in spare slot P
    bound_at = torch.gather(mass, 3, ids.clamp(max=n_pages - 1))
    over = torch.where(ok, bound_at - exact, 0.0).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp(min=1)
    spare = torch.cat([mass - over, mass.new_zeros(b, h_kv, h // h_kv, 1)], dim=-1)
    return spare.scatter(3, ids, torch.where(ok, exact, 0.0))[..., :n_pages].reshape(b, h, n_pages)


def nominate_pages(state: KVState, q: Tensor, scores: Tensor, forced: Tensor, k_max: int, count: Tensor,
                   factor: float) -> Selection:
    """Two-level page choice: the cheap page ``scores`` (the box bound, group-folded, ``[B, H_kv, P]``)
    nominate ``factor`` times the pages as candidates (`candidate_budget`); the key-sketch bound of
    those candidates alone ranks them, and the best ``count`` (forced pages first) are kept, ascending.

    The sketch's codes are read for the candidates only, so the step reads the box summaries, plus
    ``factor`` times the budget's codes, not the sketch of the whole cache. A page the box does not
    nominate is never kept: the fidelity rests on the box ranking the right page in its top
    ``factor × budget``, which is much weaker than ranking it in its top budget."""
    wide, wide_count = candidate_budget(k_max, count, factor, state.cache.num_pages)
    candidates = choose_topk(scores, forced, wide, wide_count, block=state.page_size, workspace=state.workspace)
    listed = candidates.indices.masked_fill(~candidates.entry_valid(), -1)  # -1: the kernel's empty entry
    forced = forced if forced.dim() == 3 else forced[:, None, :].expand_as(scores)
    forced_listed = torch.gather(forced, 2, listed.clamp(min=0).long()) & (listed >= 0)
    return rank_candidates(state, q, candidates, k_max, count, forced=forced_listed)


def rank_candidates(state: KVState, q: Tensor, candidates: Selection, k_max: int, count: Tensor, *,
                    forced: Tensor | None = None, sinks: int = 0, window: int = 0) -> Selection:
    """Keep the best ``count`` of the candidate ``pages`` by their key-sketch bound (the group's max),
    the forced candidates first, ascending. Forced: those flagged in ``forced`` (``bool``, shaped as
    the candidates' indices), or without it the pages of the ``sinks`` and ``window``, found from the
    candidates' page ids inside the choice (`choose_page_scores`)."""
    c = state.cache
    listed = candidates.indices.masked_fill(~candidates.entry_valid(), -1)  # -1: the kernel's empty entry
    sketch = kernels.sketch_page_bound(q, c.key_sketch[state.layer], c.page_min[state.layer], c.page_max[state.layer],
                                       c.start, c.length, state.scale, "max", listed)  # [B, H_kv, wide]
    k_kept = min(k_max, candidates.k_max)
    if forced is None:
        chosen = choose_page_scores(state, sketch, k_kept, count, sinks, window, ids=listed)
    else:
        chosen = choose_topk(sketch, forced, k_kept, count, workspace=state.workspace)
    # Candidates ascend and so do the chosen entries: the kept page ids ascend too.
    return Selection(torch.gather(candidates.indices, 2, chosen.indices.long()), chosen.count, block=state.page_size)


def choose_page_scores(state: KVState, scores: Tensor, k_max: int, count: Tensor | Budget, sinks: int, window: int,
                       ids: Tensor | None = None) -> Selection:
    """The pages of the ``sinks`` and ``window`` plus the best others by page ``scores [B, H_kv, N]``,
    at most ``count`` per row (a tensor, or the policy's `Budget` of the visible pages), ascending;
    pages without a visible token are never kept. The entries are the pages ``0 .. N-1``, or the
    page ids ``ids int[B, H_kv, N]`` (``-1``: none; ``count`` a tensor), and the selection holds
    positions in ``scores``.

    The same choice as `choose_topk` of the scores masked by `KVState.page_valid` and the flags of
    `forced_pages`, but the kernel finds the visible and forced pages and the budget from the rows'
    spans (`kernels.select_page_scores`), so the step writes none of those ``[B, P]`` tensors."""
    c, page = state.cache, state.page_size
    ratio, pages = page_count_rule(count, page) if isinstance(count, Budget) else (0.0, 0)
    given = None if isinstance(count, Budget) else count
    if fused_rows(scores.shape[-1]):
        indices, kept = kernels.select_page_scores(scores, c.start, c.length, k_max, given, page, sinks, window, ratio,
                                                   pages, ids, workspace=state.workspace)
        return Selection(indices, kept, block=page if ids is None else 1)
    masked, forced, given = kernels.reference.page_choice_inputs(scores, c.start, c.length, given, page, sinks, window,
                                                                 ratio, pages, ids)
    return choose_topk_steps(masked, forced, k_max, given, page if ids is None else 1, workspace=state.workspace)


def box_pages(state: KVState, q: Tensor, k_max: int, count: Tensor | Budget, sinks: int, window: int) -> Selection:
    """The top pages by the box bound folded by each group's max (`group_page_bounds`), the pages of
    the ``sinks`` and ``window`` first (`forced_pages`), at most ``count`` per row (a tensor, or the
    policy's `Budget` of the visible pages), ascending: `choose_topk` of those, with the bound and
    the choice in one launch (`kernels.select_pages`: neither the bounds nor the flags are written)."""
    c, page = state.cache, state.page_size
    if not kernels.select_pages_takes(c.num_pages):
        if isinstance(count, Budget):
            count = kernels.reference.page_count(state.page_valid().sum(-1), *page_count_rule(count, page))
        return choose_topk(group_page_bounds(state, q, "box"), forced_pages(state, sinks, window), k_max, count,
                           block=page, workspace=state.workspace)
    ratio, pages = page_count_rule(count, page) if isinstance(count, Budget) else (0.0, 0)
    indices, kept = kernels.select_pages(q, c.page_min[state.layer], c.page_max[state.layer], c.start, c.length,
                                         state.scale, k_max, None if isinstance(count, Budget) else count, page,
                                         sinks, window, ratio, pages, workspace=state.workspace)
    return Selection(indices, kept, block=page)


def choose_pages(
    state: KVState, q: Tensor, scores: Tensor | None, forced: Tensor | None, k_max: int, count: Tensor | Budget, *,
    rescore: float = 0.0, nominate: float = 0.0, sinks: int = 0, window: int = 0, aggregate: Aggregate = "max",
) -> Selection:
    """A page policy's choice from its page ``scores``: the top pages (`choose_topk`), or with
    ``nominate`` >= 1 the best by key sketch among that many times the pages (`nominate_pages`; the
    ``scores`` are then the box bound's, folded by group max). With ``rescore`` >= 1, that many times
    the pages are chosen so, as candidates of which `rescore_pages` keeps the best tokens (the same
    token budget).

    ``forced=None``: the pages of ``sinks`` and ``window`` are forced, found inside the choice from
    the rows' spans, and ``count`` may be the policy's `Budget`, evaluated on the device
    (`choose_page_scores`). ``scores=None`` too: the pages are ranked by the box bound folded by the
    group's max, and the bound and the choice are one launch (`box_pages`). The same selection as
    the scores of `group_page_bounds` (masked by `KVState.page_valid`) and the flags of
    `forced_pages`."""
    page, n_pages = state.page_size, state.cache.num_pages
    if isinstance(count, Budget) and (rescore or nominate or forced is not None):
        count = kernels.reference.page_count(state.page_valid().sum(-1), *page_count_rule(count, page))
    k_pages, pages_count = candidate_budget(k_max, count, rescore, n_pages) if rescore else (k_max, count)
    if nominate and scores is None:
        wide, wide_count = candidate_budget(k_pages, pages_count, nominate, n_pages)
        candidates = box_pages(state, q, wide, wide_count, sinks, window)
        pages = rank_candidates(state, q, candidates, k_pages, pages_count, sinks=sinks, window=window)
    elif nominate:
        forced = forced_pages(state, sinks, window) if forced is None else forced
        pages = nominate_pages(state, q, scores, forced, k_pages, pages_count, nominate)
    elif scores is None:
        pages = box_pages(state, q, k_pages, pages_count, sinks, window)
    elif forced is None:
        pages = choose_page_scores(state, scores, k_pages, pages_count, sinks, window)
    else:
        pages = choose_topk(scores, forced, k_pages, pages_count, block=page, workspace=state.workspace)
    if not rescore:
        return pages
    return rescore_pages(state, q, pages, count * page, k_max * page, sinks, window, aggregate)
