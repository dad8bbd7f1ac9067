"""Fused page selection (Triton): a page policy's whole choice in one launch, or two for long rows;
spec: `reference.py`, beside this file.

Before, a box `Quest` choice was the grouped bound kernel, torch glue (the invalid pages masked,
the forced pages, the bf16 rounding, the counts) and `select_top`, whose one program per row held
the whole row and searched it: 8 programs for 8 KV heads, latency-bound. Here the programs that
score the pages also prepare the selection:

1. Each program takes ``BLOCK`` entries of one row (a row: one batch row and KV head): it scores
   them (`_select_pages_kernel`: the box bound folded by the group's max, `quest_page_bound`'s own
   code, so the bounds are that op's bit for bit) or loads given scores (`_select_scores_kernel`),
   applies validity and forcing, and maps each entry to a 16-bit ranking key: its score rounded to
   bf16 (`reference.round_for_ranking`), forced entries ``+inf``, as `select_top` orders bf16 bits
   (negatives flipped, ``-0`` as ``+0``); invalid entries get ``-2^15``, below every valid key.
2. It stores its keys (int16) and adds them to its row's histogram of the keys' top 12 bits (4,096
   bins, in the caller's `Workspace`). Pages of a context share few bins (bf16 bounds of similar
   size), so the keys of each group of ``GROUP`` lanes are counted among themselves first and each
   distinct bin takes one atomic (`_tally`); the forced entries are counted likewise.
3. The choice (`_finish`) reads the histogram: from its cumulative counts, the bin holding the
   ``kept``-th largest key; four halvings of that bin's 16 keys over the row's keys, held in
   registers, give the exact threshold key and the count above it; one prefix sum then writes the
   kept positions in ascending order (`select_top`'s `_emit`: every key above the threshold, and the
   first keys equal to it while fewer than wanted came before). It zeroes the histogram and the
   counters again, so the workspace is zero between launches.

   Who chooses depends on the row's length (`SelectPagesConfig.finish_min_row`). For a short row,
   the row's last scoring program: an arrival counter per row finds it (a barrier orders every
   thread's stores before the counter's release, the counter's acquire orders them before that
   program's reads, which go past L1: the sparse GEMV's pattern). For a long row, a second launch of
   one program per row (`_finish_kernel`), with warps of its own: the choice is a chain of block-wide
   reductions and scans over the whole row, which one scoring program's 4 warps make slow (the box
   selection at 128K on an H100: 15.6 µs after the row's last arrival, against 9.2 µs for a launch
   of 8 warps, its start included).

A launch's ``STAGES`` (`ALL_STAGES`, unless a probe asks) stop each program after step 1 (1), 2 (2)
or its arrival (3), and the choice after finding the threshold's bin (4): the breakdown probe
(`benchmarks.select_bench --breakdown`) times each step so. Only 5 selects; 2-3 leave the workspace
dirty, 4 leaves it zero but writes no positions.

Ties therefore go to the lowest position, as in `select_top`, and the kept count is
``min(max(count, forced), k_max, valid)`` as in `kv.choose.choose_topk`. A row is held in registers by
its choosing program as a power-of-two tile and a smaller tail (`select_top.tiles`), so rows of up
to `MAX_ROW` entries; the op sends longer ones elsewhere.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route
from ..quest_page_bound.kernel import grouped_bound
from ..select_top.kernel import _emit

# Bins of the histogram per row: a key's top 12 bits; its low 4 bits are found by the choice.
HIST_BINS = 4096
LOW_BITS = 4
# The steps of a launch (`STAGES`): score, tally, arrive, find the bin, choose.
ALL_STAGES = 5
# Counters per row after the histograms: arrivals, then forced entries.
COUNTERS = 2
# The key of an invalid entry: below every valid key (those of -inf and up are -32641 and up).
NO_KEY = -32768


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def workspace_entries(rows: int) -> int:
    """int32 entries a launch over ``rows`` rows needs zeroed: the histograms, then the counters."""
    return rows * (HIST_BINS + COUNTERS)


@triton.jit
def _ranking_keys(score, forced, valid):
    """int32 keys in ``[-2^15, 2^15)`` ordered as the entries rank: the score rounded to bf16 to
    nearest (the bits' top half after adding 2^15, `reference.round_for_ranking`), ``+inf`` where
    forced, negatives flipped so that the keys order as the values, ``-0`` as ``+0``; `NO_KEY`
    where not valid."""
    s = tl.where(forced, float("inf"), score)
    top = (s.to(tl.int32, bitcast=True) + 0x8000) >> 16  # arithmetic shift: the bf16 bits, sign-extended
    top = tl.where(top == -32768, 0, top)
    key = tl.where(top < 0, top ^ 0x7FFF, top)
    return tl.where(valid, key, -32768)


@triton.jit
def _tally(key, forced, hist_row, ctr_row, BLOCK: tl.constexpr, GROUP: tl.constexpr, LOW: tl.constexpr):
    """Add a block's valid keys to its row's histogram of ``key >> LOW`` and its forced entries to
    the row's forced count. Within each group of ``GROUP`` lanes, the lanes of one bin are counted
    together and its first lane adds the count: one atomic per distinct bin and group."""
    lane = tl.arange(0, BLOCK)
    bins = tl.where(key != -32768, (key + 32768) >> LOW, -1 - lane)  # an invalid lane matches nothing
    groups = tl.reshape(bins, (BLOCK // GROUP, GROUP))
    same = groups[:, :, None] == groups[:, None, :]
    j = tl.arange(0, GROUP)
    n_same = tl.sum(same.to(tl.int32), 2)
    first = tl.min(tl.where(same, j[None, None, :], GROUP), 2) == j[None, :]
    tl.atomic_add(hist_row + groups, n_same, mask=first & (groups >= 0), sem="relaxed", scope="gpu")
    n_forced = tl.sum(forced.to(tl.int32), 0)
    tl.atomic_add(ctr_row + 1, n_forced, mask=n_forced > 0, sem="relaxed", scope="gpu")


@triton.jit
def _row_workspace(ws_ptr, ctr_offset, row, NB: tl.constexpr):
    """``(hist_row, ctr_row)``: a row's histogram and its two counters (arrivals, forced) in the workspace."""
    return ws_ptr + row * NB, ws_ptr + ctr_offset + row * 2


@triton.jit
def _count_in(key, lo, hi):
    return tl.sum(((key >= lo) & (key < hi)).to(tl.int32), 0)


@triton.jit
def _row_keys(keys_row, offs, n):
    return tl.load(keys_row + offs, mask=offs < n, other=-32768, cache_modifier=".cg").to(tl.int32)


@triton.jit
def _row_count(cnt_ptr, s_cb, s_ch, b, kv, start_ptr, len_ptr, n_pages, page, ratio_bits, fixed,
               COUNT: tl.constexpr):
    """The entries row ``(b, kv)`` wants (int64): given per row or per KV head (``COUNT`` 1), a keep
    ratio of its visible pages (2, in float64 as `kv.Budget.count`) or a fixed number (0)."""
    if COUNT == 1:
        count = tl.load(cnt_ptr + b * s_cb + kv * s_ch).to(tl.int64)
    elif COUNT == 2:
        start = tl.load(start_ptr + b)
        length = tl.load(len_ptr)
        n_visible = tl.minimum(tl.cdiv(length, page), n_pages) - start // page
        n_visible = tl.where(length > start, n_visible, 0)
        ratio = ratio_bits.to(tl.float64, bitcast=True)
        count = tl.ceil(n_visible.to(tl.float64) * ratio - tl.full((), 1e-9, tl.float64)).to(tl.int64)
    else:
        count = tl.full((), 0, tl.int64) + fixed
    return count


@triton.jit
def _top_bin(hist_row, ctr_row, count, k_max, NB: tl.constexpr):
    """From a row's finished histogram and forced count: ``(kept, w, top, n_above)``, the entries it
    keeps (``min(max(count, forced), k_max, valid)``), the same at least 1 (kept 0 selects nothing,
    which `_emit` masks; the search needs a key), the bin of the ``w``-th largest key (the highest bin
    with at least ``w`` keys at or above it) and the keys in the bins above it."""
    bins = tl.arange(0, NB)
    h = tl.load(hist_row + bins, cache_modifier=".cg")
    n_valid = tl.sum(h, 0)
    n_forced = tl.load(ctr_row + 1, cache_modifier=".cg")
    want = tl.minimum(tl.maximum(count, n_forced.to(tl.int64)), k_max)
    kept = tl.minimum(want, n_valid.to(tl.int64)).to(tl.int32)
    w = tl.maximum(kept, 1)
    at_or_above = n_valid - tl.cumsum(h, 0) + h
    top = tl.max(tl.where(at_or_above >= w, bins, -1), 0)
    n_above = tl.sum(tl.where(bins > top, h, 0), 0)
    return kept, w, top, n_above


@triton.jit
def _pad(idx_row, kept, k_max, BLOCK: tl.constexpr):
    """Zeros at positions ``kept .. k_max-1`` of a row's indices."""
    offs = tl.arange(0, BLOCK)
    for p0 in range(0, k_max, BLOCK):
        p = p0 + offs
        tl.store(idx_row + p, tl.zeros((BLOCK,), tl.int32), mask=(p < k_max) & (p >= kept))


@triton.jit
def _finish(keys_row, hist_row, ctr_row, idx_row, kept_ptr, row, count, n, k_max,
            NB: tl.constexpr, LOW: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_TAIL: tl.constexpr,
            STAGES: tl.constexpr):
    """A row's choice, once its keys and histogram are complete: its kept count, then the positions
    of its ``kept`` best keys in ascending order and zeros after them; the row's histogram and
    counters back to zero. The row's keys are held in registers (a power-of-two tile and a tail)."""
    bins = tl.arange(0, NB)
    kept, w, top, n_above = _top_bin(hist_row, ctr_row, count, k_max, NB)
    tl.store(kept_ptr + row, kept)
    _pad(idx_row, kept, k_max, ROW_BLOCK)
    if STAGES >= 5:
        offs = tl.arange(0, ROW_BLOCK)
        offs_tail = ROW_BLOCK + tl.arange(0, ROW_TAIL if ROW_TAIL > 0 else 16)
        key = _row_keys(keys_row, offs, n)
        key_tail = _row_keys(keys_row, offs_tail, n)
        first_key = top * (1 << LOW) - 32768
        lo, n_hi = _threshold_in_bin(key, key_tail, first_key, w - n_above, LOW, ROW_TAIL)
        t = first_key + lo  # the kept-th largest key
        wanted = kept - (n_above + n_hi)  # keys equal to t to keep, by position
        zero = tl.zeros((), tl.int32)
        above, inside = _emit(idx_row, key, offs, key != -32768, t, t + 1, wanted, zero, zero, kept)
        if ROW_TAIL > 0:
            _emit(idx_row, key_tail, offs_tail, key_tail != -32768, t, t + 1, wanted, above, inside, kept)
    tl.debug_barrier()  # every thread has read the histogram before any zeroes it
    tl.store(hist_row + bins, tl.zeros((NB,), tl.int32))
    tl.store(ctr_row + tl.arange(0, 2), tl.zeros((2,), tl.int32))


@triton.jit
def _threshold_in_bin(key, key_tail, first_key, need, LOW: tl.constexpr, ROW_TAIL: tl.constexpr):
    """``(lo, n_hi)`` of the bin from ``first_key``: the low bits of its ``need``-th largest key
    (``need`` >= 1: the bins above hold fewer than wanted) and the bin's keys above that one, by
    ``LOW`` halvings of the bin's ``2^LOW`` keys over the row's keys."""
    end_key = first_key + (1 << LOW)
    lo = tl.zeros((), tl.int32)
    hi = tl.full((), 1 << LOW, tl.int32)
    n_hi = tl.zeros((), tl.int32)  # keys of the bin at or above first_key + hi
    for _ in tl.static_range(LOW):
        mid = (lo + hi) // 2
        n_ge = _count_in(key, first_key + mid, end_key)
        if ROW_TAIL > 0:
            n_ge += _count_in(key_tail, first_key + mid, end_key)
        up = n_ge >= need
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid)
        n_hi = tl.where(up, n_hi, n_ge)
    return lo, n_hi


@triton.jit
def _arrive(ctr_row):
    """Whether this program is its row's last to arrive (after all of its stores and atomics)."""
    tl.debug_barrier()
    return tl.atomic_add(ctr_row, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1


@triton.jit
def _page_flags(page_id, inside, start_ptr, len_ptr, b, page, sinks, window):
    """``(seen, forced)`` of the pages ``page_id`` of batch row ``b`` (`reference.page_flags`): a
    page is seen when it holds a visible slot, forced when it also holds one of the row's first
    ``sinks`` or last ``window`` visible slots (``window`` >= 1). Lanes outside the row
    (``inside`` false) or of page id -1 are neither."""
    start = tl.load(start_ptr + b)
    length = tl.load(len_ptr)
    lo = page_id.to(tl.int64) * page
    first = tl.maximum(lo, start)
    last = tl.minimum(lo + page, length)
    seen = inside & (page_id >= 0) & (first < last)
    return seen, seen & ((first < start + sinks) | (last > length - window))


@triton.jit
def _select_pages_kernel(
    q_ptr, mn_ptr, mx_ptr, start_ptr, len_ptr, cnt_ptr, keys_ptr, ws_ptr, idx_ptr, kept_ptr,
    s_qb, s_qh, s_mb, s_mh, s_mp, s_xb, s_xh, s_xp, s_cb, s_ch,
    n_pages, k_max, scale, page, sinks, window, ratio_bits, fixed, ctr_offset,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT: tl.constexpr, IEEE: tl.constexpr, COUNT: tl.constexpr, GROUP: tl.constexpr, NB: tl.constexpr,
    LOW: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_TAIL: tl.constexpr, STAGES: tl.constexpr = ALL_STAGES,
):
    pid_p = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    row = b * tl.num_programs(1) + kv
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < n_pages
    pd_mask = p_mask[:, None] & (offs_d < D)[None, :]
    # Padding pages and channels load 0 and add 0 (as the grouped bound's kernel).
    mn = tl.load(mn_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp + offs_d[None, :], mask=pd_mask, other=0.0)
    mx = tl.load(mx_ptr + b * s_xb + kv * s_xh + offs_p[:, None] * s_xp + offs_d[None, :], mask=pd_mask, other=0.0)
    bound = grouped_bound(q_ptr + b * s_qb + kv * G * s_qh, s_qh, mn, mx, offs_d, scale, G, G_PAD, D, BLOCK_P,
                          1, DOT, IEEE)
    seen, forced = _page_flags(offs_p, p_mask, start_ptr, len_ptr, b, page, sinks, window)
    valid = seen & (bound > float("-inf"))
    key = _ranking_keys(bound, forced & valid, valid)
    keys_row = keys_ptr + row.to(tl.int64) * n_pages
    tl.store(keys_row + offs_p, key.to(tl.int16), mask=p_mask)
    hist_row, ctr_row = _row_workspace(ws_ptr, ctr_offset, row, NB)
    if STAGES >= 2:
        _tally(key, forced, hist_row, ctr_row, BLOCK_P, GROUP, LOW)
    if STAGES >= 3:
        last = _arrive(ctr_row)
        if STAGES >= 4:
            if last:
                count = _row_count(cnt_ptr, s_cb, s_ch, b, kv, start_ptr, len_ptr, n_pages, page, ratio_bits, fixed,
                                   COUNT)
                _finish(keys_row, hist_row, ctr_row, idx_ptr + row.to(tl.int64) * k_max, kept_ptr, row, count, n_pages,
                        k_max, NB, LOW, ROW_BLOCK, ROW_TAIL, STAGES)


@triton.jit
def _select_scores_kernel(
    s_ptr, f_ptr, cnt_ptr, start_ptr, len_ptr, keys_ptr, ws_ptr, idx_ptr, kept_ptr,
    s_sb, s_sh, s_fb, s_fh, s_cb, s_ch,
    n, k_max, page, sinks, window, ratio_bits, fixed, ctr_offset,
    FLAGS: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, NB: tl.constexpr,
    LOW: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_TAIL: tl.constexpr, STAGES: tl.constexpr = ALL_STAGES,
):
    """Given scores. ``FLAGS``: the forced flags at ``f_ptr`` (0), or forcing and visibility from
    the pages' spans, the entries being the pages ``0 .. n-1`` (1) or the page ids at ``f_ptr``
    (2, -1 for none). ``COUNT``: as `_row_count`."""
    pid = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    row = b * tl.num_programs(1) + kv
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    score = tl.load(s_ptr + b * s_sb + kv * s_sh + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if FLAGS == 0:
        flag = tl.load(f_ptr + b * s_fb + kv * s_fh + offs, mask=inside, other=0)
        seen = inside
        forced = flag != 0
    else:
        if FLAGS == 1:
            page_id = offs
        else:
            page_id = tl.load(f_ptr + b * s_fb + kv * s_fh + offs, mask=inside, other=-1)
        seen, forced = _page_flags(page_id, inside, start_ptr, len_ptr, b, page, sinks, window)
    valid = seen & (score > float("-inf"))
    forced = valid & forced
    key = _ranking_keys(score, forced, valid)
    keys_row = keys_ptr + row.to(tl.int64) * n
    tl.store(keys_row + offs, key.to(tl.int16), mask=inside)
    hist_row, ctr_row = _row_workspace(ws_ptr, ctr_offset, row, NB)
    if STAGES >= 2:
        _tally(key, forced, hist_row, ctr_row, BLOCK, GROUP, LOW)
    if STAGES >= 3:
        last = _arrive(ctr_row)
        if STAGES >= 4:
            if last:
                count = _row_count(cnt_ptr, s_cb, s_ch, b, kv, start_ptr, len_ptr, n, page, ratio_bits, fixed, COUNT)
                _finish(keys_row, hist_row, ctr_row, idx_ptr + row.to(tl.int64) * k_max, kept_ptr, row, count, n, k_max,
                        NB, LOW, ROW_BLOCK, ROW_TAIL, STAGES)


@triton.jit
def _finish_kernel(
    keys_ptr, ws_ptr, cnt_ptr, start_ptr, len_ptr, idx_ptr, kept_ptr,
    s_cb, s_ch, h_kv, n, k_max, page, ratio_bits, fixed, ctr_offset,
    COUNT: tl.constexpr, NB: tl.constexpr, LOW: tl.constexpr, ROW_BLOCK: tl.constexpr, ROW_TAIL: tl.constexpr,
    STAGES: tl.constexpr = ALL_STAGES,
):
    """The choice as a launch of its own, one program per row (grid ``(rows,)``) after the scoring
    launch's keys and histograms: `_finish`, with warps of its own (`SelectPagesConfig.finish_warps`)."""
    row = tl.program_id(0)
    hist_row, ctr_row = _row_workspace(ws_ptr, ctr_offset, row, NB)
    count = _row_count(cnt_ptr, s_cb, s_ch, row // h_kv, row % h_kv, start_ptr, len_ptr, n, page, ratio_bits, fixed,
                       COUNT)
    _finish(keys_ptr + row.to(tl.int64) * n, hist_row, ctr_row, idx_ptr + row.to(tl.int64) * k_max, kept_ptr, row,
            count, n, k_max, NB, LOW, ROW_BLOCK, ROW_TAIL, STAGES)


def _own_launch(cfg, n: int) -> bool:
    """Whether rows of ``n`` entries are chosen by a launch of their own (`SelectPagesConfig.finish_min_row`)."""
    return n >= cfg.finish_min_row


def _launch_finish(cfg, stages: int, tiles: tuple[int, int], keys: Tensor, scratch: Tensor, count: Tensor | None,
                   s_cb: int, s_ch: int, idx: Tensor, kept: Tensor, h_kv: int, n: int, k_max: int, mode: int, *,
                   start: Tensor | None = None, length: Tensor | None = None, page: int = 1, ratio_bits: int = 0,
                   fixed: int = 0) -> None:
    """The choice of rows whose keys and histograms the scoring launch made, as a launch of its own
    (`_finish_kernel`); the count's arguments as `_row_count` takes them (``start`` and ``length``
    for a keep ratio). Nothing where a probe stopped before the choice (``stages`` < 4)."""
    if stages < 4:
        return
    rows = kept.numel()
    block, tail = tiles
    _finish_kernel[(rows,)](
        keys, scratch, count if count is not None else kept, kept if start is None else start,
        kept if length is None else length, idx, kept,
        s_cb, s_ch, h_kv, n, k_max, page, ratio_bits, fixed, rows * HIST_BINS,
        COUNT=mode, NB=HIST_BINS, LOW=LOW_BITS, ROW_BLOCK=block, ROW_TAIL=tail, STAGES=stages,
        num_warps=cfg.finish_warps,
    )


def _count_strides(count: Tensor | None, b: int) -> tuple[Tensor | None, int, int]:
    """``count`` per row ``[B]`` or per KV head ``[B, H_kv]`` as ``(tensor, batch stride, head stride)``."""
    if count is None:
        return None, 0, 0
    if count.dim() == 1:
        return count, count.stride(0), 0
    return count, count.stride(0), count.stride(1)


def _ratio_bits(ratio: float) -> int:
    """The float64 bits of ``ratio`` as an int64 (a float argument would reach the kernel as fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(ratio)))[0]


def select_pages(q: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
                 k_max: int, count: Tensor | None, page_size: int, sinks: int, window: int, ratio: float, pages: int,
                 scratch: Tensor, cfg, bound_cfg, tiles: tuple[int, int], stages: int = ALL_STAGES) -> tuple[Tensor, Tensor]:
    """Launch the box selection (`reference.select_pages`) with ``cfg`` (a `SelectPagesConfig`), the
    bound's method from ``bound_cfg`` (the `PageScoreConfig` of the grouped bound), ``scratch`` the
    zeroed int32 workspace (`workspace_entries`) and ``tiles`` the row's register tiles. ``stages`` < 5
    stops each program early, for the breakdown probe (`STAGES`): no selection is made then."""
    route.check_device(q)
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_min.shape
    rows = b * h_kv
    idx = _alloc(b, h_kv, k_max, dtype=torch.int32, device=q.device)
    kept = _alloc(b, h_kv, dtype=torch.int32, device=q.device)
    q, page_min, page_max = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, page_min, page_max))
    keys = _alloc(rows, n_pages, dtype=torch.int16, device=q.device)
    count, s_cb, s_ch = _count_strides(count, b)
    mode = 1 if count is not None else 2 if ratio > 0 else 0
    block, tail = tiles
    dot = bound_cfg.method == "dot"
    block_p = max(16, cfg.block_p) if dot else cfg.block_p
    grid = (triton.cdiv(n_pages, block_p), h_kv, b)
    ratio_bits = _ratio_bits(ratio)
    own = _own_launch(cfg, n_pages)
    _select_pages_kernel[grid](
        q, page_min, page_max, start, length, count if count is not None else kept, keys, scratch, idx, kept,
        q.stride(0), q.stride(1),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2), s_cb, s_ch,
        n_pages, k_max, float(scale), page_size, sinks, max(window, 1), ratio_bits, pages,
        rows * HIST_BINS,
        G=h // h_kv, G_PAD=max(16, triton.next_power_of_2(h // h_kv)), D=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_P=block_p, DOT=dot,
        # As the grouped bound's launch: fp32 dots where a dtype is fp32 or differs, and under the interpreter.
        IEEE=route.INTERPRET or q.dtype != page_min.dtype or page_min.dtype == torch.float32,
        COUNT=mode, GROUP=min(block_p, cfg.group), NB=HIST_BINS, LOW=LOW_BITS, ROW_BLOCK=block, ROW_TAIL=tail,
        STAGES=min(stages, 2) if own else stages, num_warps=cfg.num_warps,
    )
    if own:
        _launch_finish(cfg, stages, tiles, keys, scratch, count, s_cb, s_ch, idx, kept, h_kv, n_pages, k_max, mode,
                       start=start, length=length, page=page_size, ratio_bits=ratio_bits, fixed=pages)
    return idx, kept


def select_scores(scores: Tensor, forced: Tensor, count: Tensor, k_max: int, scratch: Tensor, cfg,
                  tiles: tuple[int, int], stages: int = ALL_STAGES) -> tuple[Tensor, Tensor]:
    """Launch the selection from given scores and forced flags (`reference.select_scores`); as `select_pages`."""
    forced = forced if forced.stride(-1) == 1 else forced.contiguous()
    return _launch_scores(scores, forced.view(torch.uint8), 0, count, k_max, scratch, cfg, tiles, stages)


def select_page_scores(scores: Tensor, start: Tensor, length: Tensor, k_max: int, count: Tensor | None,
                       page_size: int, sinks: int, window: int, ratio: float, pages: int, ids: Tensor | None,
                       scratch: Tensor, cfg, tiles: tuple[int, int], stages: int = ALL_STAGES) -> tuple[Tensor, Tensor]:
    """Launch the selection from given page scores, visibility and forcing from the pages' spans
    (`reference.select_page_scores`); as `select_pages`."""
    if ids is not None:
        ids = (ids if ids.stride(-1) == 1 else ids.contiguous()).to(torch.int32)
    return _launch_scores(scores, ids, 1 if ids is None else 2, count, k_max, scratch, cfg, tiles, stages,
                          start=start, length=length, page=page_size, sinks=sinks, window=max(window, 1), ratio=ratio,
                          fixed=pages)


def _launch_scores(scores: Tensor, flags: Tensor | None, flag_mode: int, count: Tensor | None, k_max: int,
                   scratch: Tensor, cfg, tiles: tuple[int, int], stages: int, *, start: Tensor | None = None,
                   length: Tensor | None = None, page: int = 1, sinks: int = 0, window: int = 1, ratio: float = 0.0,
                   fixed: int = 0) -> tuple[Tensor, Tensor]:
    """`_select_scores_kernel` over ``scores [B, H_kv, N]``, with ``flags`` (forced flags or page
    ids, ``[B, N]`` or ``[B, H_kv, N]``) as ``flag_mode`` (its ``FLAGS``), then the choice's own
    launch for long rows."""
    route.check_device(scores)
    b, h_kv, n = scores.shape
    idx = _alloc(b, h_kv, k_max, dtype=torch.int32, device=scores.device)
    kept = _alloc(b, h_kv, dtype=torch.int32, device=scores.device)
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    s_fb, s_fh = (0, 0) if flags is None else (flags.stride(0), 0) if flags.dim() == 2 else (flags.stride(0), flags.stride(1))
    keys = _alloc(b * h_kv, n, dtype=torch.int16, device=scores.device)
    count, s_cb, s_ch = _count_strides(count, b)
    mode = 1 if count is not None else 2 if ratio > 0 else 0
    ratio_bits = _ratio_bits(ratio)
    block, tail = tiles
    grid = (triton.cdiv(n, cfg.block_n), h_kv, b)
    own = _own_launch(cfg, n)
    _select_scores_kernel[grid](
        scores, kept if flags is None else flags, kept if count is None else count,
        kept if start is None else start, kept if length is None else length, keys, scratch, idx, kept,
        scores.stride(0), scores.stride(1), s_fb, s_fh, s_cb, s_ch,
        n, k_max, page, sinks, window, ratio_bits, fixed, b * h_kv * HIST_BINS,
        FLAGS=flag_mode, COUNT=mode, BLOCK=cfg.block_n, GROUP=min(cfg.block_n, cfg.group), NB=HIST_BINS, LOW=LOW_BITS,
        ROW_BLOCK=block, ROW_TAIL=tail, STAGES=min(stages, 2) if own else stages, num_warps=cfg.num_warps,
    )
    if own:
        _launch_finish(cfg, stages, tiles, keys, scratch, count, s_cb, s_ch, idx, kept, h_kv, n, k_max, mode,
                       start=start, length=length, page=page, ratio_bits=ratio_bits, fixed=fixed)
    return idx, kept


__all__ = ["HIST_BINS", "workspace_entries", "select_page_scores", "select_pages", "select_scores"]
