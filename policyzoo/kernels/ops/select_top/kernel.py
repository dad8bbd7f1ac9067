"""Top-``count`` selection by threshold search and compaction (Triton); spec: `reference.select_top`,
beside this file.

``torch.topk`` on a GPU costs tens of µs per call at decode sizes (a radix select over several
launches, plus a sort when the order matters), more than the reads it saves for a keep-0.5
projection or a page selection. Here one program per row does it in one launch, the whole row held
in registers:

1. Map each score to an ``int32`` key with the same order (a float's bits, negatives flipped), so
   ties are exact. A bf16 score's key comes from its own 16 bits, sign-extended: the same keys as
   its fp32 bits shifted right by 16, without the round trip through fp32 (the kernel is
   issue-bound). fp32 and fp16 scores go through fp32 (fp16 does not order like a truncated fp32).
2. Search a bracket ``[lo, hi)`` of keys with ``#{key >= lo} >= count > #{key >= hi}`` (`_search`),
   starting from the row's smallest and largest keys. Each step counts the keys at or above a probe
   and snaps the moved end to the nearest key, in one three-value reduction; the probe interpolates
   on the counts. It stops when one distinct key is left in the bracket or all of it is wanted:
   on activations and page bounds, about half the steps of a plain bisection over the key range.
   Snapping keeps forced ``+inf`` pages and rows with few distinct keys from slowing the
   interpolation; after `SelectTopConfig.interp_steps` steps it halves instead, which bounds the
   search.
3. Keep every key ``>= hi`` and the first ``count − #{key >= hi}`` keys of the bracket by position,
   and write their positions in ascending order, zeros after ``count``: one prefix sum of two packed
   flags gives each kept key its output slot (`_emit`).

Long bf16 rows (`SelectTopConfig.hist_min_n` entries and more: the down projection's 14,336 inputs)
are instead spread over several programs, since one SM holding the whole row is their bottleneck:
two 256-bin histograms of their 16-bit keys give the exact threshold, in four launches
(`select_by_histograms`), the histograms in a zeroed buffer they leave zero.

A row held by one program is a power-of-two tile and a smaller power-of-two tail (`tiles`, chosen
by the op): a row just over a power of two would otherwise double the tile and the time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output comes from here (uninitialised; the tests poison it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _keys(s_row, offs, n, ABS: tl.constexpr, BITS: tl.constexpr):
    """Order-preserving int32 keys of the scores at ``offs`` (``-2^31`` off the end). With ``BITS``
    the row holds bf16 bits as int16: the keys are those of their fp32 values shifted right by 16."""
    if BITS:
        b = tl.load(s_row + offs, mask=offs < n, other=0).to(tl.int32)  # sign-extended: b << 16 is the fp32 bits
        if ABS:
            key = b & 0x7FFF  # clearing the sign also makes -0.0 (0x8000) 0
        else:
            b = tl.where(b == -32768, 0, b)  # -0.0 ranks with +0.0
            key = tl.where(b < 0, b ^ 0x7FFF, b)  # the high half of (b << 16) ^ 0x7FFFFFFF
    else:
        x = tl.load(s_row + offs, mask=offs < n, other=0.0).to(tl.float32)
        if ABS:
            x = tl.abs(x)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0 as floats, but not as bits
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives: larger magnitude, smaller key
    return tl.where(offs < n, key, -2147483647 - 1)


@triton.jit
def _count(mask):
    return tl.sum(mask.to(tl.int32), axis=0)


@triton.jit
def _merge_stats(n_a, above_a, below_a, n_b, above_b, below_b):
    return n_a + n_b, tl.minimum(above_a, above_b), tl.maximum(below_a, below_b)


@triton.jit
def _stats(key, mid):
    """``(#{key >= mid}, min{key >= mid}, max{key < mid})`` of one tile, in one reduction (``2^31-1``
    and ``-2^31`` stand for an empty min and max; padding keys are ``-2^31``)."""
    ge = key >= mid
    return tl.reduce((ge.to(tl.int32), tl.where(ge, key, 2147483647), tl.where(ge, -2147483647 - 1, key)),
                     0, _merge_stats)


@triton.jit
def _row_stats(key, key_tail, mid, TAIL: tl.constexpr):
    n_ge, above, below = _stats(key, mid)
    if TAIL > 0:
        n_tail, above_tail, below_tail = _stats(key_tail, mid)
        n_ge, above, below = _merge_stats(n_ge, above, below, n_tail, above_tail, below_tail)
    return n_ge, above, below


@triton.jit
def _search(key, key_tail, valid, valid_tail, want, INTERP_STEPS: tl.constexpr, TAIL: tl.constexpr):
    """A bracket ``[lo, hi)`` of keys with ``#{key >= lo} >= want > #{key >= hi} = n_hi``, narrowed
    until the keys >= hi plus the first ``want - n_hi`` in the bracket are the ``want`` largest: one
    distinct key left in it (``lo`` is then the ``want``-th largest key), or all of it wanted.

    Each step counts the keys at or above a probe and snaps the moved end to the nearest key (the
    smallest one above, the largest one below plus one), so the bracket's ends are always keys: ties
    and gaps (a few forced ``+inf`` pages above finite bounds) cost no extra steps. The probe
    interpolates on the counts for the first ``INTERP_STEPS`` steps, then halves the bracket (which
    bounds the steps by 32 more)."""
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64) + 1
    n_lo = _count(valid)
    if TAIL > 0:
        lo = tl.minimum(lo, tl.min(tl.where(valid_tail, key_tail, 2147483647), axis=0).to(tl.int64))
        hi = tl.maximum(hi, tl.max(key_tail, axis=0).to(tl.int64) + 1)
        n_lo += _count(valid_tail)
    n_hi = tl.zeros((), tl.int32)
    step = tl.zeros((), tl.int32)
    while (hi - lo > 1) & (n_lo != want):
        width = hi - lo
        # The fraction of the bracket's keys to leave above the probe, as if spread evenly over it.
        frac = (n_lo - want).to(tl.float32) + 0.5
        frac = frac / (n_lo - n_hi).to(tl.float32)
        guess = (frac * width.to(tl.float32)).to(tl.int64)
        offset = tl.where(step < INTERP_STEPS, tl.minimum(tl.maximum(guess, 1), width - 1), width // 2)
        # lo < mid < hi <= 2^31: the bounds need int64, the probe fits the keys' int32.
        mid = (lo + offset).to(tl.int32)
        n_ge, above, below = _row_stats(key, key_tail, mid, TAIL)
        up = n_ge >= want
        lo = tl.where(up, above.to(tl.int64), lo)
        n_lo = tl.where(up, n_ge, n_lo)
        hi = tl.where(up, hi, below.to(tl.int64) + 1)
        n_hi = tl.where(up, n_hi, n_ge)
        step += 1
    return lo.to(tl.int32), hi, n_hi


@triton.jit
def _emit(i_row, key, pos, valid, lo, hi, wanted, above_seen, inside_seen, c):
    """Write the positions of one tile's kept keys in order: every key >= hi, and the keys in
    ``[lo, hi)`` while fewer than ``wanted`` of them came before. ``above_seen`` and ``inside_seen``
    count the earlier tiles' keys >= hi and bracket keys; returns both updated.

    Both of the tile's running counts come from one prefix sum of two flags packed in an int32 (a
    tile holds at most 2^14 keys, so neither half overflows; the earlier tiles' counts stay
    unpacked, since a long row's may pass 2^15): a kept key's output slot is the keys >= hi before
    it plus the kept bracket keys before it."""
    above = valid & (key >= hi)
    inside = valid & (key >= lo) & (key < hi)
    flags = inside.to(tl.int32) + (above.to(tl.int32) << 16)
    before = tl.cumsum(flags, axis=0) - flags
    inside_before = inside_seen + (before & 0xFFFF)
    keep = (above | (inside & (inside_before < wanted))) & (tl.zeros_like(flags) < c)  # count 0: none
    out = above_seen + (before >> 16) + tl.minimum(inside_before, wanted)
    tl.store(i_row + out, pos.to(tl.int32), mask=keep)
    total = tl.sum(flags, axis=0)
    return above_seen + (total >> 16), inside_seen + (total & 0xFFFF)


@triton.jit
def _wanted(cnt_ptr, row, n, k_max):
    """``(c, want)``: the row's count within ``[0, min(k_max, n)]``, and the same at least 1 (count 0
    selects nothing, which `_emit` masks; the search needs one key to look for)."""
    c = tl.minimum(tl.load(cnt_ptr + row).to(tl.int32), k_max)
    c = tl.minimum(tl.maximum(c, 0), n)
    return c, tl.maximum(c, 1)


@triton.jit
def _select_top_kernel(
    s_ptr, cnt_ptr, idx_ptr,
    n, k_max, s_row_stride, i_row_stride,
    ABS: tl.constexpr, BITS: tl.constexpr, INTERP_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr,
):
    row = tl.program_id(0)
    s_row = s_ptr + row * s_row_stride
    i_row = idx_ptr + row * i_row_stride
    c, want = _wanted(cnt_ptr, row, n, k_max)
    offs = tl.arange(0, BLOCK_N)
    # Padding first: positions count..k_max-1 hold 0.
    for p0 in range(0, k_max, BLOCK_N):
        p = p0 + offs
        tl.store(i_row + p, tl.zeros((BLOCK_N,), tl.int32), mask=(p < k_max) & (p >= c))

    # The row in registers: a power-of-two tile, and a smaller one for what is left (unused when
    # TAIL is 0: then its lanes are all past the end, and the compiler drops them).
    offs_tail = BLOCK_N + tl.arange(0, TAIL if TAIL > 0 else 16)
    key = _keys(s_row, offs, n, ABS, BITS)
    key_tail = _keys(s_row, offs_tail, n, ABS, BITS)
    valid, valid_tail = offs < n, offs_tail < n
    lo, hi, n_hi = _search(key, key_tail, valid, valid_tail, want, INTERP_STEPS, TAIL)

    # Compaction: every key >= hi, then the bracket's keys by position until count is reached.
    wanted = c - n_hi
    zero = tl.zeros((), tl.int32)
    above, inside = _emit(i_row, key, offs, valid, lo, hi, wanted, zero, zero, c)
    if TAIL > 0:
        _emit(i_row, key_tail, offs_tail, valid_tail, lo, hi, wanted, above, inside, c)


# ------------------------------------------------------------------------------ by histograms
# A bf16 key has 16 bits: two 256-bin histograms find the count-th largest exactly. Each launch
# spreads the row over programs of `hist_chunk` entries, so a long row is not one SM's work, at the
# price of four launches. The histograms live in a zeroed buffer, `[R, 512]` (high byte, then low
# byte), which they leave zero.


@triton.jit
def _chunk_keys(s_ptr, row, chunk, n, s_row_stride, ABS: tl.constexpr, CHUNK: tl.constexpr):
    """A chunk's bf16 keys (`_keys`, from the 16 bits), their unsigned form ``key + 2^15`` in
    ``[0, 2^16)``, the positions and which are in the row."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    key = _keys(s_ptr + row * s_row_stride, offs, n, ABS, True)
    return key, key + 32768, offs, offs < n


@triton.jit
def _top_bin(h, want):
    """``(bin, count above it)``: the highest bin of the 256-bin histogram ``h`` at or above which
    ``want >= 1`` entries lie."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    b = tl.max(tl.where(at_or_above >= want, bins, -1), 0)
    return b, tl.sum(tl.where(bins > b, h, 0), 0)


@triton.jit
def _histogram(values, counted, CHUNK: tl.constexpr):
    """256-bin histogram of ``values`` where ``counted`` (the others land in bin 0, taken back)."""
    h = tl.histogram(tl.where(counted, values, 0), 256)
    return h - tl.where(tl.arange(0, 256) == 0, CHUNK - tl.sum(counted.to(tl.int32), 0), 0)


@triton.jit
def _hist_high_kernel(s_ptr, hist_ptr, n, s_row_stride, ABS: tl.constexpr, CHUNK: tl.constexpr):
    chunk, row = tl.program_id(0), tl.program_id(1)
    _, u, _, valid = _chunk_keys(s_ptr, row, chunk, n, s_row_stride, ABS, CHUNK)
    tl.atomic_add(hist_ptr + row * 512 + tl.arange(0, 256), _histogram(u >> 8, valid, CHUNK))


@triton.jit
def _hist_low_kernel(s_ptr, cnt_ptr, hist_ptr, n, k_max, s_row_stride, ABS: tl.constexpr, CHUNK: tl.constexpr):
    chunk, row = tl.program_id(0), tl.program_id(1)
    _, want = _wanted(cnt_ptr, row, n, k_max)
    high, _ = _top_bin(tl.load(hist_ptr + row * 512 + tl.arange(0, 256)), want)
    _, u, _, valid = _chunk_keys(s_ptr, row, chunk, n, s_row_stride, ABS, CHUNK)
    tl.atomic_add(hist_ptr + row * 512 + 256 + tl.arange(0, 256), _histogram(u & 255, valid & ((u >> 8) == high), CHUNK))


@triton.jit
def _chunk_counts_kernel(s_ptr, cnt_ptr, hist_ptr, part_ptr, n, k_max, s_row_stride,
                         ABS: tl.constexpr, CHUNK: tl.constexpr):
    """The exact threshold key, and each chunk's counts of keys above it and equal to it."""
    chunk, row = tl.program_id(0), tl.program_id(1)
    _, want = _wanted(cnt_ptr, row, n, k_max)
    high, above_high = _top_bin(tl.load(hist_ptr + row * 512 + tl.arange(0, 256)), want)
    low, above_low = _top_bin(tl.load(hist_ptr + row * 512 + 256 + tl.arange(0, 256)), want - above_high)
    t = high * 256 + low - 32768  # the count-th largest key
    key, _, _, valid = _chunk_keys(s_ptr, row, chunk, n, s_row_stride, ABS, CHUNK)
    part = part_ptr + (row * tl.num_programs(0) + chunk) * 2
    tl.store(part, tl.sum((valid & (key > t)).to(tl.int32), 0))
    tl.store(part + 1, tl.sum((valid & (key == t)).to(tl.int32), 0))
    if chunk == 0:  # the threshold and the keys above it, for the emit launch
        tl.store(part_ptr + (tl.num_programs(1) * tl.num_programs(0) + row) * 2, t)
        tl.store(part_ptr + (tl.num_programs(1) * tl.num_programs(0) + row) * 2 + 1, above_high + above_low)


@triton.jit
def _hist_emit_kernel(s_ptr, cnt_ptr, hist_ptr, part_ptr, idx_ptr, n, k_max, s_row_stride, i_row_stride,
                      ABS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Positions of the kept keys in order (`_emit`, with the earlier chunks' counts as its start),
    this chunk's share of the zero padding, and the histograms back to zero."""
    chunk, row = tl.program_id(0), tl.program_id(1)
    n_chunks = tl.num_programs(0)
    c, _ = _wanted(cnt_ptr, row, n, k_max)
    params = part_ptr + (tl.num_programs(1) * n_chunks + row) * 2
    t, n_above = tl.load(params), tl.load(params + 1)
    earlier = tl.arange(0, CHUNKS_PAD)
    part = part_ptr + (row * n_chunks + earlier) * 2
    before = earlier < chunk
    above_before = tl.sum(tl.load(part, mask=before, other=0), 0)
    ties_before = tl.sum(tl.load(part + 1, mask=before, other=0), 0)
    key, _, offs, valid = _chunk_keys(s_ptr, row, chunk, n, s_row_stride, ABS, CHUNK)
    i_row = idx_ptr + row * i_row_stride
    _emit(i_row, key, offs, valid, t, t + 1, c - n_above, above_before, ties_before, c)
    pad = c + offs  # positions count..k_max-1 hold 0; chunk i writes CHUNK of them
    tl.store(i_row + pad, tl.zeros((CHUNK,), tl.int32), mask=pad < k_max)
    if chunk == 0:
        tl.store(hist_ptr + row * 512 + tl.arange(0, 512), tl.zeros((512,), tl.int32))


def select_by_histograms(
    scores: Tensor, count: Tensor, k_max: int, absolute: bool, hist: Tensor, idx: Tensor, chunk: int
) -> None:
    """The histogram method on bf16 ``scores [R, N]`` into ``idx``, ``chunk`` entries per program;
    ``hist`` the zeroed ``[R * 512]`` buffer (zero again afterwards)."""
    r, n = scores.shape
    chunks = triton.cdiv(n, chunk)
    bits, stride = scores.view(torch.int16), scores.stride(0)
    # Per chunk: keys above, keys equal; then per row: threshold, keys above it.
    part = _alloc(r * chunks + r, 2, dtype=torch.int32, device=scores.device)
    grid, meta = (chunks, r), dict(ABS=absolute, CHUNK=chunk, num_warps=4)
    _hist_high_kernel[grid](bits, hist, n, stride, **meta)
    _hist_low_kernel[grid](bits, count, hist, n, k_max, stride, **meta)
    _chunk_counts_kernel[grid](bits, count, hist, part, n, k_max, stride, **meta)
    _hist_emit_kernel[grid](bits, count, hist, part, idx, n, k_max, stride, idx.stride(0),
                            CHUNKS_PAD=max(16, triton.next_power_of_2(chunks)), **meta)


def select_top(scores: Tensor, count: Tensor, k_max: int, absolute: bool, cfg, hist: Tensor | None,
               tiles: tuple[int, int]) -> Tensor:
    """``int32[R, k_max]``: per row of ``scores [R, N]``, the positions of its ``count[r]`` largest
    entries (of ``|scores|`` with ``absolute``) in ascending order, then zeros (`reference.select_top`).

    ``cfg``: the `SelectTopConfig` for the call; ``hist``: the zeroed ``[R * 512]`` buffer to take the
    histogram method with (None: one program per row, holding ``tiles = (BLOCK_N, TAIL)`` entries)."""
    r, n = scores.shape
    idx = _alloc(r, k_max, dtype=torch.int32, device=scores.device)
    if r == 0 or k_max == 0:
        return idx
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    count = count.contiguous()
    if hist is not None:
        select_by_histograms(scores, count, k_max, absolute, hist, idx, cfg.hist_chunk)
        return idx
    block, tail = tiles
    bf16 = scores.dtype == torch.bfloat16
    _select_top_kernel[(r,)](
        scores.view(torch.int16) if bf16 else scores, count, idx, n, k_max, scores.stride(0), idx.stride(0),
        ABS=absolute, BITS=bf16, INTERP_STEPS=cfg.interp_steps, BLOCK_N=block, TAIL=tail, num_warps=cfg.num_warps,
    )
    return idx
