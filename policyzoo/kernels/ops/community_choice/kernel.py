"""`CommunityKV`'s choice of communities (Triton), group mode; spec: `reference.community_choice`,
beside this file.

The reference sorts every community of a KV head by score (13,106 parts a head at 32K with
``split=4``: a segmented radix sort, about 42 µs a layer on an H100) and turns the ranked ranges into
slots through tensors as wide as the budget. The choice needs no order, only a threshold: the
communities above it are taken whole, and those at it by id until the budget is full. Here three
launches over chunks of ``CHUNK`` communities a program, each of them reading ``O(communities +
their tokens)``, find it and write the slots:

1. `_weigh_kernel`: each community's 16-bit ranking key (its score rounded to bf16, as
   `select_pages` orders bf16 bits) and its *weight*, the slots of its range free to take (visible,
   not forced: the budget counts those), read from the layout; a weighted histogram of the keys' high
   bytes per row (bit planes of the weights, one `tl.histogram` each); the chunk's best ``top``
   communities for the next token's candidates, and its community with the most room left.
2. `_low_kernel`: the high byte holding the budget's last token, and the weighted histogram of the
   low bytes within it, added to the row's and kept per chunk with the chunk's weight above that
   byte. The first program of a row merges the chunks' candidates and roomiest communities; the
   last to arrive (an arrival counter) finds the exact threshold key ``t`` and the tokens wanted at
   it, turns the chunks' histograms into each chunk's weight above ``t`` and at ``t`` before it
   (prefix sums over the chunks), and zeroes the row's histograms and counter.
3. `_emit_kernel`: each community's tokens taken (all above ``t``; at ``t``, by id, what the earlier
   ones leave) and its first output entry (a prefix sum over ids), then its range's free slots; the
   first program of a row writes the forced slots.

The kept slots come out by community id (the reference's come in rank order): the same set, which
is the contract. The histograms and counters live in the caller's zeroed workspace, left zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..select_pages.kernel import _ranking_keys
from ..select_top.kernel import _histogram, _top_bin

# int32 entries a row needs zeroed: the weighted histograms of the keys' high bytes, then low bytes,
# then the arrival counter of `_low_kernel`.
HIST = 513
# A chunk's summary for the row's last `_low_kernel` program: its weight above the threshold's high
# byte, its whole weight, and its weighted histogram of low bytes within that byte.
SUMMARY = 2 + 256
_HIST: tl.constexpr = tl.constexpr(HIST)  # the kernels' copies
_SUMMARY: tl.constexpr = tl.constexpr(SUMMARY)


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _span(start_ptr, length_ptr, row, heads):
    """The row's visible slots ``[start, length)``."""
    return tl.load(start_ptr + row // heads).to(tl.int32), tl.load(length_ptr).to(tl.int32)


@triton.jit
def _range_slots(order_row, off, sz, w0, start, length, sinks, window, WIDTH: tl.constexpr):
    """Entries ``w0 .. w0 + WIDTH`` of each community's range (``[CHUNK, WIDTH]``) and which of them are
    free to take: inside the range, visible, not a sink, not in the window."""
    pos = w0 + tl.arange(0, WIDTH)[None, :]
    inside = pos < sz[:, None]
    slot = tl.load(order_row + off[:, None] + pos, mask=inside, other=0)
    # Visible and not forced: past the row's sinks (so past its start) and before its window.
    free = inside & (slot >= start + sinks) & (slot < length - window)
    return slot, free


@triton.jit
def _weighted_histogram(bins, weight, counted, CHUNK: tl.constexpr):
    """256-bin histogram of ``bins`` where ``counted``, each entry counting its ``weight >= 0``: one
    plain histogram per bit of the weights (parts have a few tokens: two or three bits)."""
    weight = tl.where(counted, weight, 0)
    most = tl.max(weight, 0)
    h = tl.zeros((256,), tl.int32)
    bit = 0
    while (most >> bit) > 0:
        h += _histogram(bins, counted & (((weight >> bit) & 1) == 1), CHUNK) << bit
        bit += 1
    return h


@triton.jit
def _chunk(chunk, row, m, CHUNK: tl.constexpr):
    """The program's community ids, which of them exist, and the row's first entry."""
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    return ids, ids < m, row.to(tl.int64) * m


@triton.jit
def _weigh_kernel(s_ptr, size_ptr, room_ptr, off_ptr, order_ptr, start_ptr, length_ptr, key_ptr, w_ptr, hist_ptr,
                  cand_ptr, roomy_ptr, m, order_stride, sinks, window, heads, top,
                  CHUNK: tl.constexpr, WIDTH: tl.constexpr):
    chunk, row = tl.program_id(0), tl.program_id(1)
    ids, valid, base = _chunk(chunk, row, m, CHUNK)
    score = tl.load(s_ptr + base + ids, mask=valid, other=0.0)
    size = tl.load(size_ptr + base + ids, mask=valid, other=0)
    sz = size.to(tl.int32)
    # The chunk's community with the most room left (ties: the lower id), for the row's merge.
    slack = tl.load(room_ptr + base + ids, mask=valid, other=0) - size
    tl.store(roomy_ptr + row * tl.num_programs(0) + chunk,
             tl.max(tl.where(valid, (slack << 32) | (0x7FFFFFFF - ids), -1), 0))
    off = tl.load(off_ptr + base + ids, mask=valid, other=0)
    # Padding communities (no tokens) rank at -inf, as in the reference: candidates still, never taken.
    key = _ranking_keys(tl.where(sz == 0, float("-inf"), score), ids < 0, valid)
    start, length = _span(start_ptr, length_ptr, row, heads)
    order_row = order_ptr + row.to(tl.int64) * order_stride
    weight = tl.zeros((CHUNK,), tl.int32)
    for w0 in range(0, tl.max(sz, 0), WIDTH):
        _, free = _range_slots(order_row, off, sz, w0, start, length, sinks, window, WIDTH)
        weight += tl.sum(free.to(tl.int32), 1)
    tl.store(key_ptr + base + ids, key, mask=valid)
    tl.store(w_ptr + base + ids, weight, mask=valid)
    h = _weighted_histogram((key + 32768) >> 8, weight, valid & (weight > 0), CHUNK)
    tl.atomic_add(hist_ptr + row * _HIST + tl.arange(0, 256), h, mask=h != 0, sem="relaxed", scope="gpu")
    # The chunk's best `top`: the larger key first, at equal keys the lower id. Ranked as int32 words
    # (the 16-bit key over the id within the chunk: cheaper reductions than int64), stored as int64
    # words over the row's ids for the merge.
    local = tl.arange(0, CHUNK)
    packed = tl.where(valid, ((key + 32768) << 15) | (32767 - local), -1)
    cand_row = cand_ptr + (row * tl.num_programs(0) + chunk) * top
    for i in range(top):
        best = tl.max(packed, 0)
        best_id = chunk * CHUNK + 32767 - (best & 32767)
        tl.store(cand_row + i, tl.where(best < 0, -1, ((best >> 15).to(tl.int64) << 32) | (0x7FFFFFFF - best_id)))
        packed = tl.where(packed == best, -1, packed)


@triton.jit
def _low_kernel(free_ptr, key_ptr, w_ptr, hist_ptr, cand_ptr, best_ptr, roomy_ptr, roomiest_ptr, sum_ptr, part_ptr,
                m, heads, top, n_best, CHUNK: tl.constexpr, CAND_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    chunk, row = tl.program_id(0), tl.program_id(1)
    n_chunks = tl.num_programs(0)
    free = tl.load(free_ptr + row // heads).to(tl.int32)
    hist_row = hist_ptr + row * _HIST
    bins = tl.arange(0, 256)
    high, _ = _top_bin(tl.load(hist_row + bins), tl.maximum(free, 1))  # -1: fewer tokens than wanted
    ids, valid, base = _chunk(chunk, row, m, CHUNK)
    key = tl.load(key_ptr + base + ids, mask=valid, other=-32768)
    weight = tl.load(w_ptr + base + ids, mask=valid, other=0)
    u = key + 32768
    h = _weighted_histogram(u & 255, weight, valid & (weight > 0) & ((u >> 8) == high), CHUNK)
    tl.atomic_add(hist_row + 256 + bins, h, mask=h != 0, sem="relaxed", scope="gpu")
    summary = sum_ptr + (row * n_chunks + chunk) * _SUMMARY
    tl.store(summary, tl.sum(tl.where((u >> 8) > high, weight, 0), 0))
    tl.store(summary + 1, tl.sum(weight, 0))
    tl.store(summary + 2 + bins, h)
    if chunk == 0:  # the row's roomiest community, and its best `n_best` among the chunks' candidates
        chunks = tl.arange(0, CHUNKS_PAD)
        roomy = tl.max(tl.load(roomy_ptr + row * n_chunks + chunks, mask=chunks < n_chunks, other=-1), 0)
        tl.store(roomiest_ptr + row, 0x7FFFFFFF - (roomy & 0x7FFFFFFF))
        n = n_chunks * top
        offs = tl.arange(0, CAND_PAD)
        cand = tl.load(cand_ptr + row * n + offs, mask=offs < n, other=-1)
        for i in range(n_best):
            best = tl.max(cand, 0)
            tl.store(best_ptr + row * n_best + i, 0x7FFFFFFF - (best & 0x7FFFFFFF))
            cand = tl.where(cand == best, -1, cand)
    tl.debug_barrier()  # every store and atomic of this program before its arrival
    if tl.atomic_add(hist_row + 512, 1, sem="acq_rel", scope="gpu") == n_chunks - 1:
        _threshold(free, hist_row, sum_ptr + row * n_chunks * _SUMMARY, part_ptr, row, n_chunks, CHUNKS_PAD)


@triton.jit
def _threshold(free, hist_row, sums, part_ptr, row, n_chunks, CHUNKS_PAD: tl.constexpr):
    """The row's last `_low_kernel` program: the exact threshold key ``t``, the tokens wanted at it and
    in all (``params``), each chunk's weight above ``t`` and at ``t`` in the chunks before it (exclusive
    prefix sums), and the row's histograms and counter back to zero."""
    bins = tl.arange(0, 256)
    h_high = tl.load(hist_row + bins)
    total = tl.sum(h_high, 0)
    high, above_high = _top_bin(h_high, tl.maximum(free, 1))
    low, above_low = _top_bin(tl.load(hist_row + 256 + bins), tl.maximum(free - above_high, 1))
    # Nothing wanted: no key reaches t. Fewer tokens than wanted: every key is above t.
    nothing, everything = free <= 0, total <= free
    t = tl.where(nothing, 32768, tl.where(everything, -32769, high * 256 + low - 32768))
    at_t = tl.where(nothing | everything, 0, free - above_high - above_low)
    taken = tl.minimum(tl.maximum(free, 0), total)
    chunks = tl.arange(0, CHUNKS_PAD)
    inside = chunks < n_chunks
    summary = sums + chunks * _SUMMARY
    lows = tl.load(summary[:, None] + 2 + bins[None, :], mask=inside[:, None], other=0)
    above = tl.load(summary, mask=inside, other=0) + tl.sum(tl.where(bins[None, :] > low, lows, 0), 1)
    above = tl.where(everything, tl.load(summary + 1, mask=inside, other=0), tl.where(nothing, 0, above))
    ties = tl.where(nothing | everything, 0, tl.sum(tl.where(bins[None, :] == low, lows, 0), 1))
    part = part_ptr + (row * n_chunks + chunks) * 2
    tl.store(part, tl.cumsum(above, 0) - above, mask=inside)
    tl.store(part + 1, tl.cumsum(ties, 0) - ties, mask=inside)
    params = part_ptr + tl.num_programs(1) * n_chunks * 2 + row * 3
    tl.store(params, t)
    tl.store(params + 1, at_t)
    tl.store(params + 2, taken)
    tl.debug_barrier()  # every thread has read the histograms before any zeroes them
    tl.store(hist_row + tl.arange(0, 512), tl.zeros((512,), tl.int32))
    tl.store(hist_row + 512, 0)


@triton.jit
def _emit_kernel(size_ptr, off_ptr, order_ptr, start_ptr, length_ptr, key_ptr, w_ptr, part_ptr,
                 idx_ptr, count_ptr, m, order_stride, sinks, window, heads, k_max,
                 CHUNK: tl.constexpr, WIDTH: tl.constexpr, FORCED_PAD: tl.constexpr):
    chunk, row = tl.program_id(0), tl.program_id(1)
    n_chunks = tl.num_programs(0)
    params = part_ptr + tl.num_programs(1) * n_chunks * 2 + row * 3
    t, at_t, n_taken = tl.load(params), tl.load(params + 1), tl.load(params + 2)
    part = part_ptr + (row * n_chunks + chunk) * 2
    above_before, ties_before = tl.load(part), tl.load(part + 1)

    ids, valid, base = _chunk(chunk, row, m, CHUNK)
    key = tl.load(key_ptr + base + ids, mask=valid, other=-32768)
    weight = tl.load(w_ptr + base + ids, mask=valid, other=0)
    above = valid & (key > t)
    tie = valid & (key == t)
    w_above = tl.where(above, weight, 0)
    w_tie = tl.where(tie, weight, 0)
    tie_before = ties_before + tl.cumsum(w_tie, 0) - w_tie  # the tied tokens of lower ids
    taken = tl.where(above, weight, tl.where(tie, tl.minimum(tl.maximum(at_t - tie_before, 0), weight), 0))
    first = above_before + tl.cumsum(w_above, 0) - w_above + tl.minimum(tie_before, at_t)

    sz = tl.load(size_ptr + base + ids, mask=valid, other=0).to(tl.int32)
    sz = tl.where(taken > 0, sz, 0)  # only the taken communities' ranges are read
    off = tl.load(off_ptr + base + ids, mask=valid, other=0)
    start, length = _span(start_ptr, length_ptr, row, heads)
    order_row = order_ptr + row.to(tl.int64) * order_stride
    idx_row = idx_ptr + row.to(tl.int64) * k_max
    seen = tl.zeros((CHUNK,), tl.int32)
    for w0 in range(0, tl.max(sz, 0), WIDTH):
        slot, free = _range_slots(order_row, off, sz, w0, start, length, sinks, window, WIDTH)
        ones = free.to(tl.int32)
        rank = seen[:, None] + tl.cumsum(ones, 1) - ones
        tl.store(idx_row + first[:, None] + rank, slot, mask=free & (rank < taken[:, None]))
        seen += tl.sum(ones, 1)

    # The forced slots after the taken ones: the sinks, then the window, each visible one once.
    j = tl.arange(0, FORCED_PAD)
    is_sink = j < sinks
    f_slot = tl.where(is_sink, start + j, length - window + (j - sinks))
    f_ok = (j < sinks + window) & tl.where(is_sink, f_slot < length, f_slot >= start + sinks)
    count = n_taken + tl.sum(f_ok.to(tl.int32), 0)
    if chunk == 0:
        f_at = n_taken + tl.cumsum(f_ok.to(tl.int32), 0) - 1
        tl.store(idx_row + f_at, f_slot, mask=f_ok)
        tl.store(count_ptr + row, count)
    for p0 in range(chunk * CHUNK, k_max, n_chunks * CHUNK):  # entries count..k_max-1 hold 0
        p = p0 + tl.arange(0, CHUNK)
        tl.store(idx_row + p, tl.zeros((CHUNK,), tl.int32), mask=(p >= count) & (p < k_max))


def community_choice(scores: Tensor, size: Tensor, room: Tensor, offset: Tensor, order: Tensor, start: Tensor,
                     length: Tensor, free: Tensor, k_max: int, sinks: int, window: int, top: int, hist: Tensor,
                     cfg) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group mode (one unit per KV head): ``scores, size, room, offset [B, H_kv, C]``, ``order [B, H_kv, W]``
    → ``(indices int32[B, H_kv, k_max], count int32[B, H_kv], best int64[B, H_kv, min(top, C)], roomiest
    int64[B, H_kv, 1])``
    (`reference.community_choice`); ``sinks`` and ``window`` already capped at the capacity; ``hist``
    the zeroed ``[B·H_kv·HIST]`` workspace (zero again afterwards); ``cfg`` the `CommunityChoiceConfig`."""
    b, heads, m = size.shape
    rows, device = b * heads, scores.device
    n_best = min(top, m)
    idx = _alloc(b, heads, k_max, dtype=torch.int32, device=device)
    count = _alloc(b, heads, dtype=torch.int32, device=device)
    best = _alloc(b, heads, n_best, dtype=torch.int64, device=device)
    roomiest = _alloc(b, heads, 1, dtype=torch.int64, device=device)
    if rows == 0:
        return idx, count, best, roomiest
    chunk = cfg.chunk
    chunks = triton.cdiv(m, chunk)
    scores, size, room, offset, order = (t.contiguous() for t in (scores.float(), size, room, offset, order))
    keys = _alloc(rows * m, dtype=torch.int32, device=device)
    weights = _alloc(rows * m, dtype=torch.int32, device=device)
    cand = _alloc(rows * chunks * top, dtype=torch.int64, device=device)
    roomy = _alloc(rows * chunks, dtype=torch.int64, device=device)
    sums = _alloc(rows * chunks * SUMMARY, dtype=torch.int32, device=device)
    part = _alloc(rows * chunks * 2 + rows * 3, dtype=torch.int32, device=device)
    start, length, free = start.contiguous(), length.reshape(1), free.contiguous()
    grid = (chunks, rows)
    meta = dict(CHUNK=chunk, num_warps=cfg.num_warps)
    _weigh_kernel[grid](scores, size, room, offset, order, start, length, keys, weights, hist, cand, roomy,
                        m, order.stride(1), sinks, window, heads, top, WIDTH=cfg.width, **meta)
    _low_kernel[grid](free, keys, weights, hist, cand, best, roomy, roomiest, sums, part, m, heads, top, n_best,
                      CAND_PAD=max(16, triton.next_power_of_2(chunks * top)),
                      CHUNKS_PAD=max(16, triton.next_power_of_2(chunks)), **meta)
    _emit_kernel[grid](size, offset, order, start, length, keys, weights, part, idx, count,
                       m, order.stride(1), sinks, window, heads, k_max, WIDTH=cfg.width,
                       FORCED_PAD=max(16, triton.next_power_of_2(sinks + window)), **meta)
    return idx, count, best, roomiest
