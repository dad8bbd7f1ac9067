"""Top-``count`` selection by threshold search and compaction (Triton); spec: `reference.select_top`.

``torch.topk`` on a GPU costs 20–50 µs per call at decode sizes (a radix select over several
launches, plus a sort when the order matters), more than the reads it saves for a keep-0.5
projection or a page selection. Here one program per row does it in one launch:

1. Map each score to an ``int32`` key with the same order (a float's bits, negatives flipped), so
   ties are exact; bf16 inputs carry only 16 significant bits, so their keys are shifted right by 16.
2. Bisect for the largest key ``T`` with ``#{key >= T} >= count`` (one count per step: 32 steps for
   fp32, 16 for bf16, 15 for bf16 magnitudes).
   Each step is one block-wide count, so the cost is latency. Two searches with fewer steps were
   built and measured slower on an H200 (sweep `variants`, `benchmarks/results/2026-11-29-h200-run3`):
   8 bits per 256-bin ``tl.histogram`` pass (11.2 against 9.4 µs for 4,096 bf16 entries, 34 against
   20 µs for 8 rows of 8,192 fp32), and 3 bits per step from 7 counts packed into one reduction
   (13.0 against 9.3 µs, 32 against 20 µs): each of their steps costs more than it saves.
3. Keep every key ``> T`` and the first ``count − #{key > T}`` keys ``== T`` by position, and write
   their positions in ascending order (a running prefix sum), zeros after ``count``.

The whole row is held in registers, up to 16384 entries (every activation vector and the pages of a
256K context), as a power-of-two tile and a smaller power-of-two tail (`tiles`): a row just over a
power of two would otherwise double the tile, and 8,203 pages in one 16,384-entry tile measured 39–46
µs against 18 µs for 8,192 (H200, `benchmarks/results/2026-11-29-h200-run4`). Longer rows are
re-read per step (correct, but the torch reference is the faster choice there, see
`dispatch.select_top`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK_N = 16384  # entries a row may have to stay in registers
# Warps per program: 0 picks by the entries held (4 up to 4096, 8 above). On an H200 (sweep
# `variants`), 8 warps beat 16 on 14,336 bf16 entries (20.8 against 22.5 µs) and on 8 rows of 8,192
# fp32 (18.1 against 20.9 µs); 4 warps are as fast as 8 on 4,096 entries.
NUM_WARPS = 0


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output comes from here (uninitialised; the tests poison it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _keys(s_row, offs, n, ABS: tl.constexpr, SHIFT: tl.constexpr):
    """Order-preserving int32 keys of the scores at ``offs`` (``-2^31`` off the end)."""
    x = tl.load(s_row + offs, mask=offs < n, other=0.0).to(tl.float32)
    if ABS:
        x = tl.abs(x)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0 as floats, but not as bits
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives: larger magnitude, smaller key
    key = key >> SHIFT
    return tl.where(offs < n, key, -2147483647 - 1)


@triton.jit
def _count(mask):
    return tl.sum(mask.to(tl.int32), axis=0)


@triton.jit
def _emit(i_row, key, pos, n, threshold, ties_wanted, ties_seen, written, c):
    """Write the positions of one tile's kept keys after the ``written`` ones; returns the updated
    ``(ties_seen, written)``: every key above the threshold, ties by position until count is reached."""
    valid = pos < n
    tie = (key == threshold) & valid
    tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among ties so far
    keep = valid & ((key > threshold) | (tie & (tie_rank <= ties_wanted)))
    keep = keep & (tl.zeros_like(tie_rank) < c)  # count 0: nothing (a tensor, not a scalar, for the mask)
    out = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(i_row + out, pos.to(tl.int32), mask=keep)
    return ties_seen + _count(tie), written + _count(keep)


@triton.jit
def _select_top_kernel(
    s_ptr, cnt_ptr, idx_ptr,
    n, k_max, s_row_stride, i_row_stride,
    ABS: tl.constexpr, SHIFT: tl.constexpr, ITERS: tl.constexpr, LO: tl.constexpr,
    BLOCK_N: tl.constexpr, TAIL: tl.constexpr, SINGLE: tl.constexpr,
):
    row = tl.program_id(0)
    s_row = s_ptr + row * s_row_stride
    i_row = idx_ptr + row * i_row_stride
    c = tl.minimum(tl.load(cnt_ptr + row).to(tl.int32), k_max)
    c = tl.minimum(tl.maximum(c, 0), n)
    offs = tl.arange(0, BLOCK_N)
    # Padding first: positions count..k_max-1 hold 0.
    for p0 in range(0, k_max, BLOCK_N):
        p = p0 + offs
        tl.store(i_row + p, tl.zeros((BLOCK_N,), tl.int32), mask=(p < k_max) & (p >= c))

    want = tl.maximum(c, 1)  # count 0 selects nothing (masked below); the search needs >= 1
    lo = tl.full((), LO, tl.int64)
    hi = tl.full((), LO + (1 << ITERS), tl.int64)
    if SINGLE:  # the row in registers: a power-of-two tile, and a smaller one for what is left
        key = _keys(s_row, offs, n, ABS, SHIFT)
        if TAIL > 0:
            offs_tail = BLOCK_N + tl.arange(0, TAIL)
            key_tail = _keys(s_row, offs_tail, n, ABS, SHIFT)
    for _ in range(ITERS):
        # lo <= mid < hi <= 2^31: the bounds need int64, the midpoint fits the keys' int32.
        mid = (lo + (hi - lo) // 2).to(tl.int32)
        if SINGLE:
            n_ge = _count(key >= mid)
            if TAIL > 0:
                n_ge += _count(key_tail >= mid)
        else:
            n_ge = tl.zeros((), tl.int32)
            for t0 in range(0, n, BLOCK_N):
                n_ge += _count(_keys(s_row, t0 + offs, n, ABS, SHIFT) >= mid)
        up = n_ge >= want
        lo = tl.where(up, mid.to(tl.int64), lo)
        hi = tl.where(up, hi, mid.to(tl.int64))
    threshold = lo.to(tl.int32)

    # Compaction: every key above the threshold, then ties by position until count is reached.
    if SINGLE:
        n_gt = _count(key > threshold)
        if TAIL > 0:
            n_gt += _count(key_tail > threshold)
    else:
        n_gt = tl.zeros((), tl.int32)
        for t0 in range(0, n, BLOCK_N):
            n_gt += _count(_keys(s_row, t0 + offs, n, ABS, SHIFT) > threshold)
    ties_wanted = c - n_gt
    ties_seen = tl.zeros((), tl.int32)
    written = tl.zeros((), tl.int32)
    if SINGLE:
        ties_seen, written = _emit(i_row, key, offs, n, threshold, ties_wanted, ties_seen, written, c)
        if TAIL > 0:
            ties_seen, written = _emit(i_row, key_tail, offs_tail, n, threshold, ties_wanted, ties_seen, written, c)
    else:
        for t0 in range(0, n, BLOCK_N):
            k = _keys(s_row, t0 + offs, n, ABS, SHIFT)
            ties_seen, written = _emit(i_row, k, t0 + offs, n, threshold, ties_wanted, ties_seen, written, c)


def tiles(n: int) -> tuple[int, int]:
    """``(BLOCK_N, TAIL)`` for a row of ``n`` entries: the largest power of two up to ``n`` (16 at
    least), then the smallest power of two covering the rest (0 if none), so a row just over a power
    of two costs a few more lanes, not twice as many (8,203 pages: 8,192 + 16, not 16,384). Rows
    longer than `MAX_BLOCK_N` are re-read in tiles of `MAX_BLOCK_N` (tail 0)."""
    if n > MAX_BLOCK_N:
        return MAX_BLOCK_N, 0
    block = max(16, 1 << (max(n, 1).bit_length() - 1))
    if block >= n:
        return block, 0
    tail = max(16, triton.next_power_of_2(n - block))
    return (2 * block, 0) if tail == block else (block, tail)


def select_top(scores: Tensor, count: Tensor, k_max: int, absolute: bool = False) -> Tensor:
    """``int32[R, k_max]``: per row of ``scores [R, N]``, the positions of its ``count[r]`` largest
    entries (of ``|scores|`` with ``absolute``) in ascending order, then zeros (`reference.select_top`)."""
    from .decode_attention import INTERPRET

    if scores.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")
    if scores.dim() != 2 or count.shape != scores.shape[:1]:
        raise ValueError(f"expected scores [R, N] and count [R], got {tuple(scores.shape)} and {tuple(count.shape)}")
    r, n = scores.shape
    idx = _alloc(r, k_max, dtype=torch.int32, device=scores.device)
    if r == 0 or k_max == 0:
        return idx
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    count = count.contiguous()
    half = scores.dtype == torch.bfloat16  # 16 significant bits: the low half of the key is zero
    shift = 16 if half else 0
    bits = 32 - shift - (1 if absolute else 0)  # a magnitude's key is never negative
    lo = 0 if absolute else -(1 << (31 - shift))
    block, tail = tiles(n)
    num_warps = NUM_WARPS or (4 if block + tail <= 4096 else 8)
    _select_top_kernel[(r,)](
        scores, count, idx, n, k_max, scores.stride(0), idx.stride(0),
        ABS=absolute, SHIFT=shift, ITERS=bits, LO=lo, BLOCK_N=block, TAIL=tail, SINGLE=n <= block + tail,
        num_warps=num_warps,
    )
    return idx
