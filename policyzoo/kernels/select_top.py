"""Top-``count`` selection by threshold search and compaction (Triton); spec: `reference.select_top`.

``torch.topk`` on a GPU costs 20–50 µs per call at decode sizes (a radix select over several
launches, plus a sort when the order matters), more than the reads it saves for a keep-0.5
projection or a page selection. Here one program per row does it in one launch:

1. Map each score to an unsigned key with the same order (a float's bits, negatives flipped, the
   sign bit set on non-negatives), so ties are exact. bf16 inputs carry only 16 significant bits,
   so their keys are the top 16 bits.
2. Find the largest key ``T`` with ``#{key >= T} >= count`` by narrowing ``[lo, hi)``, which
   starts as every key. Each step is a block-wide reduction, whose cost is latency, so the number
   of steps is what matters. Two searches (``SEARCH``):
   - ``"octiles"`` (default): count the keys at the 7 inner eighths of the interval in one
     reduction (the counts packed into two int64s) and keep the eighth that holds ``T``: 3 bits
     per step, 6 steps for bf16 and 11 for fp32.
   - ``"bisect"``: one count per step, 16 steps for bf16 and 32 for fp32; kept to time against.
   (A radix search, 8 bits per 256-bin ``tl.histogram`` pass, measured slower than the bisection
   on an H200: 11 against 9 µs at 4,096 bf16 entries, 34 against 20 µs at 8 rows of 8,192 fp32.)
3. Keep every key ``> T`` and the first ``count − #{key > T}`` keys ``== T`` by position, and write
   their positions in ascending order (a running prefix sum), zeros after ``count``.

The whole row is held in registers when it fits one tile (``BLOCK_N``, up to 16384 entries: every
activation vector and the pages of a 256K context); longer rows are re-read per pass (correct, but
the torch reference is the faster choice there, see `dispatch.select_top`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK_N = 16384  # entries a row may have to stay in registers
SEARCH = "octiles"  # or "bisect" (see the module docstring)


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output comes from here (uninitialised; the tests poison it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _keys(s_row, offs, n, ABS: tl.constexpr, LOW: tl.constexpr):
    """Order-preserving unsigned keys of the scores at ``offs`` (their top ``32 − LOW`` bits; 0 off the end).

    No real score maps to 0 (``-inf`` is the smallest, at ``0x007FFFFF``), so entries off the end
    sort below all of them.
    """
    x = tl.load(s_row + offs, mask=offs < n, other=0.0).to(tl.float32)
    if ABS:
        x = tl.abs(x)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0 as floats, but not as bits
    bits = x.to(tl.int32, bitcast=True)
    # Negatives: larger magnitude, smaller key; then flip the sign bit so the order is unsigned.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) ^ (-2147483647 - 1)
    key = key.to(tl.uint32, bitcast=True) >> LOW
    return tl.where(offs < n, key, 0)


@triton.jit
def _count_above(s_row, key, offs, n, t, STRICT: tl.constexpr,
                 ABS: tl.constexpr, LOW: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    """``#{key > t}`` (``STRICT``) or ``#{key >= t}`` over the row (its tile ``key`` when it fits one)."""
    total = tl.zeros((), tl.int32)
    for t0 in range(0, n, BLOCK_N):
        if SINGLE:
            k = key
        else:
            k = _keys(s_row, t0 + offs, n, ABS, LOW)
        above = (k > t) if STRICT else (k >= t)
        total += tl.sum(above.to(tl.int32), axis=0)
    return total


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _octile_step(s_row, key, offs, n, lo, hi, want,
                 ABS: tl.constexpr, LOW: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr):
    """One step of the 8-way search: count the keys at or above the 7 inner eighths of ``[lo, hi)``
    and return the eighth ``[t_j, t_{j+1})`` with ``#{key >= t_j} >= want > #{key >= t_{j+1}}``.

    The 7 counts of a tile come from one block reduction: each is < 2^16 (a tile holds at most
    16384 keys), so four share an int64 and the two int64s are reduced together.
    """
    width = hi - lo
    t1 = lo + width // 8
    t2 = lo + width * 2 // 8
    t3 = lo + width * 3 // 8
    t4 = lo + width * 4 // 8
    t5 = lo + width * 5 // 8
    t6 = lo + width * 6 // 8
    t7 = lo + width * 7 // 8
    n1 = tl.zeros((), tl.int64)
    n2 = tl.zeros((), tl.int64)
    n3 = tl.zeros((), tl.int64)
    n4 = tl.zeros((), tl.int64)
    n5 = tl.zeros((), tl.int64)
    n6 = tl.zeros((), tl.int64)
    n7 = tl.zeros((), tl.int64)
    for t0 in range(0, n, BLOCK_N):
        if SINGLE:
            k = key.to(tl.int64)
        else:
            k = _keys(s_row, t0 + offs, n, ABS, LOW).to(tl.int64)
        one = tl.full((), 1, tl.int64)
        packed_a = (tl.where(k >= t1, one, 0) + (tl.where(k >= t2, one, 0) << 16)
                    + (tl.where(k >= t3, one, 0) << 32) + (tl.where(k >= t4, one, 0) << 48))
        packed_b = tl.where(k >= t5, one, 0) + (tl.where(k >= t6, one, 0) << 16) + (tl.where(k >= t7, one, 0) << 32)
        sum_a, sum_b = tl.reduce((packed_a, packed_b), 0, _add_pairs)
        n1 += sum_a & 0xFFFF
        n2 += (sum_a >> 16) & 0xFFFF
        n3 += (sum_a >> 32) & 0xFFFF
        n4 += (sum_a >> 48) & 0xFFFF
        n5 += sum_b & 0xFFFF
        n6 += (sum_b >> 16) & 0xFFFF
        n7 += (sum_b >> 32) & 0xFFFF
    # The counts fall with j, so the eighth to keep is the number of thresholds still reaching `want`.
    j = ((n1 >= want).to(tl.int64) + (n2 >= want).to(tl.int64) + (n3 >= want).to(tl.int64)
         + (n4 >= want).to(tl.int64) + (n5 >= want).to(tl.int64) + (n6 >= want).to(tl.int64)
         + (n7 >= want).to(tl.int64))
    return lo + width * j // 8, lo + width * (j + 1) // 8


@triton.jit
def _select_top_kernel(
    s_ptr, cnt_ptr, idx_ptr,
    n, k_max, s_row_stride, i_row_stride,
    ABS: tl.constexpr, LOW: tl.constexpr, KEY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, OCTILES: tl.constexpr,
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
    key = tl.zeros((BLOCK_N,), tl.uint32)
    if SINGLE:
        key = _keys(s_row, offs, n, ABS, LOW)
    # Invariant: #{key >= lo} >= want > #{key >= hi}; T is lo once the interval has width 1.
    lo = tl.zeros((), tl.int64)
    hi = tl.full((), 1 << KEY_BITS, tl.int64)  # lo <= T < hi <= 2^32: int64 bounds, uint32 keys
    if OCTILES:
        for _ in range((KEY_BITS + 2) // 3):  # each step keeps an eighth: 3 bits of T
            lo, hi = _octile_step(s_row, key, offs, n, lo, hi, want, ABS, LOW, BLOCK_N, SINGLE)
    else:
        for _ in range(KEY_BITS):
            mid = lo + (hi - lo) // 2
            up = _count_above(s_row, key, offs, n, mid.to(tl.uint32), False, ABS, LOW, BLOCK_N, SINGLE) >= want
            lo = tl.where(up, mid, lo)
            hi = tl.where(up, hi, mid)
    threshold = lo.to(tl.uint32)

    # Compaction: every key above the threshold, then ties by position until count is reached.
    ties_wanted = c - _count_above(s_row, key, offs, n, threshold, True, ABS, LOW, BLOCK_N, SINGLE)
    ties_seen = tl.zeros((), tl.int32)
    written = tl.zeros((), tl.int32)
    for t0 in range(0, n, BLOCK_N):
        if SINGLE:
            k = key
        else:
            k = _keys(s_row, t0 + offs, n, ABS, LOW)
        valid = (t0 + offs) < n
        tie = (k == threshold) & valid
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among ties so far
        keep = valid & ((k > threshold) | (tie & (tie_rank <= ties_wanted)))
        keep = keep & (tl.zeros_like(tie_rank) < c)  # count 0: nothing (a tensor, not a scalar, for the mask)
        pos = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(i_row + pos, (t0 + offs).to(tl.int32), mask=keep)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        written += tl.sum(keep.to(tl.int32), axis=0)


def select_top(scores: Tensor, count: Tensor, k_max: int, absolute: bool = False) -> Tensor:
    """``int32[R, k_max]``: per row of ``scores [R, N]``, the positions of its ``count[r]`` largest
    entries (of ``|scores|`` with ``absolute``) in ascending order, then zeros (`reference.select_top`)."""
    from .decode_attention import INTERPRET

    if scores.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")
    if scores.dim() != 2 or count.shape != scores.shape[:1]:
        raise ValueError(f"expected scores [R, N] and count [R], got {tuple(scores.shape)} and {tuple(count.shape)}")
    if SEARCH not in ("octiles", "bisect"):
        raise ValueError(f"select_top.SEARCH must be 'octiles' or 'bisect', got {SEARCH!r}")
    r, n = scores.shape
    idx = _alloc(r, k_max, dtype=torch.int32, device=scores.device)
    if r == 0 or k_max == 0:
        return idx
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    count = count.contiguous()
    key_bits = 16 if scores.dtype == torch.bfloat16 else 32  # bf16: the low half of the key is constant
    block = min(MAX_BLOCK_N, triton.next_power_of_2(max(n, 16)))
    num_warps = 4 if block <= 4096 else 8 if block <= 8192 else 16
    _select_top_kernel[(r,)](
        scores, count, idx, n, k_max, scores.stride(0), idx.stride(0),
        ABS=absolute, LOW=32 - key_bits, KEY_BITS=key_bits, BLOCK_N=block, SINGLE=n <= block,
        OCTILES=SEARCH == "octiles", num_warps=num_warps,
    )
    return idx
