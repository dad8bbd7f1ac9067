"""Fused selection: a page policy's choice in one launch (two for long rows). Three ops share the
kernel's selection: ``policyzoo::select_pages`` scores the pages itself (the box bound folded by the
group's max, as `Quest` ranks them), ``policyzoo::select_page_scores`` takes page scores already
made and finds the visible and forced pages from the rows' spans, as `select_pages` does (a page
policy's other bounds, and the candidates of a second stage), and ``policyzoo::select_scores`` takes
scores and forced flags already made (any policy's `kv.choose.choose_topk`).

Specification: ``reference.py`` (the steps they replace: the grouped bound, the masks, the bf16
ranking and `select_top`); kernel: ``kernel.py``. The histograms and counters come from the
caller's `Workspace` (its ``select_histograms``), else are made for the call. Rows longer than
`MAX_ROW` entries are not taken (`takes`): their callers keep the steps. Launch parameters:
`SelectPagesConfig`, completed per call by `select_pages_config`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from ...config import LaunchConfig, current, next_power_of_2, non_negative, powers_of_two
from ...route import HAS_TRITON, need_triton, routed
from ...workspace import Workspace, buffer, zeroed
from ..quest_page_bound import page_score_config
from ..select_top import MAX_BLOCK_N, tiles
from . import reference

if HAS_TRITON:
    from . import kernel

# Entries a row may have: its choosing program holds the row's keys in registers, as `select_top` does
# (the pages of a 256K context at pages of 16).
MAX_ROW = MAX_BLOCK_N
# The longest row of given scores `choose_topk` sends to `select_scores`: longer rows take the steps.
# Long rows are chosen by a launch of their own, faster than the steps up to rows held in 16,384
# registers, and much slower past them (8 rows on an H100, µs, fused against the steps: 8,192
# entries 13.4 / 16.2; 8,196, a 128K cache's pages, 15.6 / 23.3; 12,288 17.8 / 26.4; 16,388 147.8 /
# 21.3; benchmarks/results/2026-12-06-h100-run29). A constant, not a launch setting: the choice is
# made while a step is traced, where no scoped config is read.
MAX_SCORES_ROW = 16384


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectPagesConfig(LaunchConfig):
    """Launch parameters of the fused selection. A program scores ``block_p`` pages (or converts
    ``block_n`` given scores) of one row; the last program of a short row chooses it with the same
    warps, a long row (`finish_min_row`) is chosen by a launch of its own."""

    keyword = "select_pages"

    block_p: int = 64
    """Pages per program of the box selection (16 at least with the bound's tl.dot): 8,192 pages
    and 8 KV heads make 1,024 programs, as the grouped bound's launch."""
    block_n: int = 512
    """Given scores per program of `select_scores`."""
    group: int = 32
    """Lanes whose keys are counted together before their histogram's atomics (one atomic per
    distinct bin of a group)."""
    num_warps: int = 4
    """Warps per program."""
    finish_min_row: int = 2048
    """Rows of this many entries or more are chosen by a launch of their own, one program of
    `finish_warps` warps per row, after the scoring launch; shorter rows by their last scoring
    program, with the scoring warps. One program's choice over a long row is a chain of block-wide
    reductions and scans: with 4 warps it costs more than a second launch with 8 (7 µs at 8,192
    pages on an H100), while at 256 pages the one launch is 1 µs faster."""
    finish_warps: int = 8
    """Warps of the choice's own launch."""

    def __post_init__(self) -> None:
        powers_of_two(self, "block_p", "block_n", "group", "num_warps", "finish_warps")
        non_negative(self, "finish_min_row")


def select_pages_config(n: int) -> SelectPagesConfig:
    """The launch parameters of a call on rows of ``n`` entries: the config in force
    (`config.current`), its block of given scores no wider than the row needs (16 at least). The
    pages' block stays as set: the bound's tile is then the grouped bound's (`PageScoreConfig`), whose
    values the choice must reproduce."""
    return _choose(current(SelectPagesConfig), n)


@functools.lru_cache(maxsize=1024)  # a launch's Python time: the same few shapes at every decode step
def _choose(cfg: SelectPagesConfig, n: int) -> SelectPagesConfig:
    return dataclasses.replace(cfg, block_n=min(cfg.block_n, max(16, next_power_of_2(n))))


def takes(n: int) -> bool:
    """Whether the fused kernels take rows of ``n`` entries (the row's keys fit one program's registers)."""
    return 0 < n <= MAX_ROW


def takes_scores(n: int) -> bool:
    """Whether `choose_topk` sends rows of ``n`` given scores to the fused kernel: rows it takes
    (`takes`) of at most `MAX_SCORES_ROW` entries."""
    return takes(n) and n <= MAX_SCORES_ROW


def _scratch(histograms: Tensor | None, rows: int, device: torch.device) -> Tensor:
    return zeroed(histograms, kernel.workspace_entries(rows), device)


@torch.library.custom_op("policyzoo::select_pages", mutates_args=())
def _select_pages_op(
    q: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float, k_max: int,
    count: Tensor | None, page_size: int, sinks: int, window: int, ratio: float, pages: int,
    histograms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    # ``histograms`` is written and left zero: to torch the op does not mutate it.
    need_triton()
    b, _, _ = q.shape
    _, h_kv, n_pages, d = page_min.shape
    if not takes(n_pages):
        raise ValueError(f"select_pages takes rows of at most {MAX_ROW} pages, got {n_pages}")
    if k_max == 0 or b * h_kv == 0:
        return q.new_zeros(b, h_kv, k_max, dtype=torch.int32), q.new_zeros(b, h_kv, dtype=torch.int32)
    return kernel.select_pages(q, page_min, page_max, start, length, scale, k_max, count, page_size, sinks, window,
                               ratio, pages, _scratch(histograms, b * h_kv, q.device), select_pages_config(n_pages),
                               page_score_config(d), tiles(n_pages))


@_select_pages_op.register_fake
def _(q, page_min, page_max, start, length, scale, k_max, count, page_size, sinks, window, ratio, pages,
      histograms=None):
    b, h_kv = q.shape[0], page_min.shape[1]
    return q.new_empty(b, h_kv, k_max, dtype=torch.int32), q.new_empty(b, h_kv, dtype=torch.int32)


@torch.library.custom_op("policyzoo::select_scores", mutates_args=())
def _select_scores_op(
    scores: Tensor, forced: Tensor, count: Tensor, k_max: int, histograms: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    need_triton()
    if scores.dim() != 3 or forced.dim() not in (2, 3) or count.dim() not in (1, 2):
        raise ValueError(f"expected scores [B, H_kv, N], forced [B, N] or [B, H_kv, N] and count [B] or [B, H_kv], got "
                         f"{tuple(scores.shape)}, {tuple(forced.shape)} and {tuple(count.shape)}")
    b, h_kv, n = scores.shape
    if not takes(n):
        raise ValueError(f"select_scores takes rows of at most {MAX_ROW} entries, got {n}")
    if k_max == 0 or b * h_kv == 0:
        return scores.new_zeros(b, h_kv, k_max, dtype=torch.int32), scores.new_zeros(b, h_kv, dtype=torch.int32)
    return kernel.select_scores(scores, forced.expand(b, h_kv, n) if forced.dim() == 3 else forced, count, k_max,
                                _scratch(histograms, b * h_kv, scores.device), select_pages_config(n), tiles(n))


@_select_scores_op.register_fake
def _(scores, forced, count, k_max, histograms=None):
    b, h_kv, _ = scores.shape
    return scores.new_empty(b, h_kv, k_max, dtype=torch.int32), scores.new_empty(b, h_kv, dtype=torch.int32)


@torch.library.custom_op("policyzoo::select_page_scores", mutates_args=())
def _select_page_scores_op(
    scores: Tensor, start: Tensor, length: Tensor, k_max: int, count: Tensor | None, page_size: int, sinks: int,
    window: int, ratio: float, pages: int, ids: Tensor | None = None, histograms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    need_triton()
    if scores.dim() != 3 or (ids is not None and ids.shape != scores.shape):
        raise ValueError(f"expected scores [B, H_kv, N] and page ids of their shape, got {tuple(scores.shape)} and "
                         f"{None if ids is None else tuple(ids.shape)}")
    if ids is not None and count is None:
        raise ValueError("select_page_scores over listed page ids needs a count: the keep ratio counts a row's pages")
    b, h_kv, n = scores.shape
    if not takes(n):
        raise ValueError(f"select_page_scores takes rows of at most {MAX_ROW} entries, got {n}")
    if k_max == 0 or b * h_kv == 0:
        return scores.new_zeros(b, h_kv, k_max, dtype=torch.int32), scores.new_zeros(b, h_kv, dtype=torch.int32)
    return kernel.select_page_scores(scores, start, length, k_max, count, page_size, sinks, window, ratio, pages, ids,
                                     _scratch(histograms, b * h_kv, scores.device), select_pages_config(n), tiles(n))


@_select_page_scores_op.register_fake
def _(scores, start, length, k_max, count, page_size, sinks, window, ratio, pages, ids=None, histograms=None):
    b, h_kv, _ = scores.shape
    return scores.new_empty(b, h_kv, k_max, dtype=torch.int32), scores.new_empty(b, h_kv, dtype=torch.int32)


def _takes_pages(q: Tensor, page_min: Tensor, *args, **kwargs) -> bool:
    return takes(page_min.shape[2])


def _takes_scores(scores: Tensor, *args, **kwargs) -> bool:
    return takes(scores.shape[-1])


@routed(reference.select_pages, takes=_takes_pages)
def select_pages(
    q: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float, k_max: int,
    count: Tensor | None = None, page_size: int = 16, sinks: int = 0, window: int = 0, ratio: float = 0.0,
    pages: int = 0, *, workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """`Quest`'s choice by the box bound folded by the group's max, in one launch → ``(indices
    int32[B, H_kv, k_max], kept int32[B, H_kv])``; see `reference.select_pages`. ``count`` (``[B]``
    or ``[B, H_kv]``), or without it ``ratio`` of the visible pages or ``pages``. ``workspace``: the
    zeroed histograms (`Workspace`)."""
    return torch.ops.policyzoo.select_pages(q, page_min, page_max, start, length, float(scale), int(k_max), count,
                                            int(page_size), int(sinks), int(window), float(ratio), int(pages),
                                            buffer(workspace, "select_histograms"))


@routed(reference.select_page_scores, takes=_takes_scores)
def select_page_scores(
    scores: Tensor, start: Tensor, length: Tensor, k_max: int, count: Tensor | None = None, page_size: int = 16,
    sinks: int = 0, window: int = 0, ratio: float = 0.0, pages: int = 0, ids: Tensor | None = None, *,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """A page policy's choice from page ``scores [B, H_kv, N]`` made elsewhere, in one launch →
    ``(indices int32[B, H_kv, k_max], kept int32[B, H_kv])``; see `reference.select_page_scores`.
    The entries are the pages ``0 .. N-1``, or the page ids ``ids`` (``-1``: none; then ``count`` is
    needed); the visible pages, the forced ones (``sinks``, ``window``) and, without ``count``, the
    budget (``ratio`` or ``pages``) come from the rows' spans (``start``, ``length``), as in
    `select_pages`. ``workspace``: the zeroed histograms (`Workspace`)."""
    return torch.ops.policyzoo.select_page_scores(scores, start, length, int(k_max), count, int(page_size), int(sinks),
                                                  int(window), float(ratio), int(pages), ids,
                                                  buffer(workspace, "select_histograms"))


@routed(reference.select_scores, takes=_takes_scores)
def select_scores(
    scores: Tensor, forced: Tensor, count: Tensor, k_max: int, *, workspace: Workspace | None = None
) -> tuple[Tensor, Tensor]:
    """The forced entries and the best others by bf16-rounded score, ``count`` per row at most, in
    one launch → ``(indices int32[B, H_kv, k_max], kept int32[B, H_kv])``; see
    `reference.select_scores`. ``workspace``: the zeroed histograms (`Workspace`)."""
    return torch.ops.policyzoo.select_scores(scores, forced, count, int(k_max), buffer(workspace, "select_histograms"))


__all__ = ["MAX_ROW", "MAX_SCORES_ROW", "SelectPagesConfig", "select_page_scores", "select_pages", "select_pages_config", "select_scores", "takes", "takes_scores"]
