"""Pooled Gaussian entmax threshold (Triton); spec: `reference.gaussian_entmax_threshold`, beside
this file.

`EntmaxKV` (``mode="gaussian"``) solves, per row of ``[B, H]`` pages, ``F(τ) = Σ_p n_p·E[(min(x_p,
cap_p) − τ)_+²] = 1``, ``x_p ~ N(m_p, s_p²)``, by safeguarded Newton steps on ``√F − 1``, each a full
pass over the row's pages: the first ones in float32, at most ``float64_steps`` in float64 (`EntmaxKV`
takes none by default), each precision's steps stopping early as the reference's do. The torch reference is a chain of
elementwise ops and last-dim sums; under `torch.compile` Inductor fuses it into one persistent
reduction over all pages, which Triton 3.6 fails to compile for 8192 pages (``PassManager::run
failed`` in make_ttgir), so this is one opaque custom op.

Where the time goes: a pass costs one censored moment pair per page (an erf, an exp and a division
each, two of them for a censored page), in float64 about 200 instructions of the GPU's float64 units,
which are 1/2 to 1/64 of its float32 units. One program per row (32 rows for batch 1) left 100 SMs
idle and ran 13 float64 passes over 8,192 pages back to back. Here:

- a row is split over ``split`` programs (`EntmaxThresholdConfig`: as many as one program per SM
  allows), each holding its slice of the pages in registers for the whole solve, with the
  τ-independent half of each moment pair (the censoring at the page's cap) computed once; a slice a
  little past a power of two (a 128K cache's 8,196 pages split four ways) is held as a block and a
  small tail block (`tail_block`), a longer one walked from memory at every step;
- each Newton step ends in a barrier of the row's programs: each writes its partial sums, counts
  itself in at the row's counter (release) and waits until all have (acquire); each then adds the
  partials in the same order, so every program of the row takes the same step. The programs of a
  row must run at once: the op never makes more programs than SMs when it splits (one program fits
  any SM), and under the interpreter, which runs programs one after another, it never splits;
- the passes far from the root are float32 (where float32 is the cheaper unit), and only the last
  (at most ``float64_steps``) float64; without them (``FINE64`` false) the kernel is float32 but for
  the row's scalars, and its float32 ``Φ`` is accurate in the lower tail (`_normal_cdf32`).

Everything float64 is as the reference's float64 steps: inputs of any float or integer dtype are
converted on load, ``Φ(a)`` is ``0.5·(1 + erf(a/√2))`` (`tl.erf`; torch's ``ndtr`` uses ``erfc`` in
the tails, ~1e-16 apart), constants that a float32 literal would round are float64 tensors. The
float32 steps round differently from torch's, which the float64 steps remove (near the root each
squares the error): results agree with the reference to ~1e-12, not bit for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route
from . import reference

# The early stops of the Newton steps (`reference.STOP_FLOAT32`, `STOP_FLOAT64`), as constants the
# kernel may read.
STOP_FLOAT32 = tl.constexpr(reference.STOP_FLOAT32)
STOP_FLOAT64 = tl.constexpr(reference.STOP_FLOAT64)
# Counters per row: the barrier's arrivals, then the programs done (the last one zeroes both).
COUNTERS = 2
# Partial sums a program publishes per step (the bracket pass: three maxima; a Newton pass: F and L).
PARTIALS = 4


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output and scratch come from here (uninitialised; the tests poison them)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _f64(x):
    """A float64 constant (a Python float literal in a kernel is a float32 constant)."""
    return tl.full((), x, tl.float64)


@triton.jit
def _relu_moments(c, s):
    """``(E[(X)_+²], E[(X)_+])`` for ``X ~ N(c, s²)`` in float64 (`reference.gaussian_relu_sq`,
    `gaussian_relu`)."""
    a = c / tl.maximum(s, _f64(1e-30))
    phi = tl.exp(-0.5 * a * a) / _f64(2.5066282746310002)  # √(2π)
    cdf = 0.5 * (1.0 + tl.erf(a * _f64(0.7071067811865476)))  # Φ(a), 1/√2
    return (c * c + s * s) * cdf + c * s * phi, c * cdf + s * phi


@triton.jit
def _normal_cdf32(a):
    """``Φ(a)`` in float32 to 1.2e-7 relative everywhere, the lower tail included: ``erfc(−a/√2)/2``
    by the Chebyshev-fitted ``erfc`` of Press et al., *Numerical Recipes* (2nd ed., §6.2). The plain
    ``(1 + erf)/2`` keeps only absolute precision, and the moments multiply ``Φ`` by ``c² + s²``
    (see `reference.normal_cdf`)."""
    z = tl.abs(a) * 0.7071067811865476  # |a|/√2
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -0.82215223 + t * 0.17087277
    poly = 1.48851587 + t * poly
    poly = -1.13520398 + t * poly
    poly = 0.27886807 + t * poly
    poly = -0.18628806 + t * poly
    poly = 0.09678418 + t * poly
    poly = 0.37409196 + t * poly
    poly = 1.00002368 + t * poly
    tail = 0.5 * t * tl.exp(-z * z - 1.26551223 + t * poly)  # Φ(−|a|)
    return tl.where(a < 0, tail, 1.0 - tail)


@triton.jit
def _relu_moments32(c, s):
    """`_relu_moments` in float32."""
    a = c / tl.maximum(s, 1e-30)
    phi = tl.exp(-0.5 * a * a) * 0.3989422804014327  # 1/√(2π)
    cdf = _normal_cdf32(a)
    return (c * c + s * s) * cdf + c * s * phi, c * cdf + s * phi


@triton.jit
def _cap_terms(m, s, cap, F32: tl.constexpr):
    """The τ-independent half of the censored moments (`reference._censored_moments`): ``(b, sq_b,
    lin_b)`` with ``b`` the cap (the mean where the cap is infinite) and the moments above it (0
    where the cap is infinite)."""
    finite = tl.abs(cap) < float("inf")
    b = tl.where(finite, cap, m)
    if F32:
        sq_b, lin_b = _relu_moments32(m - b, s)
    else:
        sq_b, lin_b = _relu_moments(m - b, s)
    return b, tl.where(finite, sq_b, 0.0), tl.where(finite, lin_b, 0.0)


@triton.jit
def _step_sums(m, s, cap, w, b, sq_b, lin_b, tau, F32: tl.constexpr):
    """``(Σ w·E[(min(X, cap) − τ)_+²], Σ w·E[(min(X, cap) − τ)_+])`` over a block of pages, given its
    `_cap_terms`."""
    if F32:
        sq, lin = _relu_moments32(m - tau, s)
    else:
        sq, lin = _relu_moments(m - tau, s)
    over_sq = sq_b + 2.0 * (b - tau) * lin_b
    below = tau < cap
    sq = tl.where(below, tl.maximum(sq - over_sq, 0.0), 0.0)
    lin = tl.where(below, tl.maximum(lin - lin_b, 0.0), 0.0)
    return tl.sum(w * sq, 0), tl.sum(w * lin, 0)


@triton.jit
def _load_block(m_row, s_row, n_row, c_row, offs, end, HAS_CAP: tl.constexpr, DTYPE: tl.constexpr):
    """One block of pages as ``DTYPE`` ``(m, s, cap, w, live)``, masked like the reference: pages not
    in the pool (and lanes past ``end``) get ``m = s = 0``, ``cap = +inf``, ``w = 0``."""
    inside = offs < end
    m = tl.load(m_row + offs, mask=inside, other=float("-inf")).to(DTYPE)
    s = tl.load(s_row + offs, mask=inside, other=0.0).to(DTYPE)
    n = tl.load(n_row + offs, mask=inside, other=0).to(DTYPE)
    live = inside & (n > 0.0) & (m > float("-inf"))
    m0 = tl.where(live, m, 0.0)
    s0 = tl.where(live, s, 0.0)
    if HAS_CAP:
        c = tl.load(c_row + offs, mask=inside, other=float("inf")).to(DTYPE)
        c0 = tl.where(live, c, float("inf"))
    else:
        c0 = tl.full(offs.shape, float("inf"), DTYPE)
    c0 = tl.maximum(c0, m0)  # a mean is never above the bound (guards float rounding)
    return m0, s0, c0, tl.where(live, n, 0.0), live


@triton.jit
def _bracket(m0, s0, c0, live):
    """The block's maxima of ``m − 8s``, ``min(m + 8s, cap)`` and ``m`` over its live pages."""
    return (tl.max(tl.where(live, m0 - 8.0 * s0, float("-inf")), 0),
            tl.max(tl.where(live, tl.minimum(m0 + 8.0 * s0, c0), float("-inf")), 0),
            tl.max(tl.where(live, m0, float("-inf")), 0))


@triton.jit
def _exchange(parts, ctr, a, b, c, step, S_PAD: tl.constexpr):
    """Publish this program's ``(a, b, c)`` (float64) for barrier ``step``, wait for the row's other
    programs, and return everyone's, ``[S_PAD]`` each (lanes past the row's programs: 0).

    The partials of consecutive steps alternate between two slots: a program still reading step k's
    cannot be overwritten, since no program passes step k+1's barrier before it arrives there."""
    split = tl.num_programs(0)
    me = tl.program_id(0)
    here = parts + ((step % 2) * S_PAD + me) * 4
    tl.store(here, a)
    tl.store(here + 1, b)
    tl.store(here + 2, c)
    # Every thread's stores before the release; the acquire before anyone's reads (past L1).
    tl.debug_barrier()
    tl.atomic_add(ctr, 1, sem="release", scope="gpu")
    target = split * (step + 1)
    while tl.atomic_add(ctr, 0, sem="acquire", scope="gpu") < target:
        pass
    j = tl.arange(0, S_PAD)
    theirs = parts + ((step % 2) * S_PAD + j) * 4
    mine = j < split
    return (tl.load(theirs, mask=mine, other=0.0, cache_modifier=".cg"),
            tl.load(theirs + 1, mask=mine, other=0.0, cache_modifier=".cg"),
            tl.load(theirs + 2, mask=mine, other=0.0, cache_modifier=".cg"), mine)


@triton.jit
def _newton(tau, lo, hi, big_f, big_l, tiny):
    """`reference.newton_step` from the pool's sums ``F`` and ``L``."""
    up = big_f >= 1.0
    lo = tl.where(up, tau, lo)
    hi = tl.where(up, hi, tau)
    step = tl.where(big_f > 0, tau + (big_f - tl.sqrt(big_f)) / tl.maximum(big_l, tiny), float("-inf"))
    return tl.minimum(tl.maximum(step, lo), hi), lo, hi


@triton.jit
def _entmax_threshold_kernel(
    m_ptr, s_ptr, n_ptr, c_ptr, out_ptr, part_ptr, ctr_ptr,
    P, per_program, coarse, fine,
    HAS_CAP: tl.constexpr, BLOCK_P: tl.constexpr, HELD: tl.constexpr, TAIL: tl.constexpr, S_PAD: tl.constexpr,
    FINE64: tl.constexpr,
):
    me = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    m_row, s_row, n_row, c_row = m_ptr + row * P, s_ptr + row * P, n_ptr + row * P, c_ptr + row * P
    first = me * per_program
    end = tl.minimum(first + per_program, P)
    parts = part_ptr + row * (2 * S_PAD * 4)
    ctr = ctr_ptr + row * 2
    offs = first + tl.arange(0, BLOCK_P)
    neg = tl.full((), float("-inf"), tl.float64)
    # Without float64 steps (``FINE64`` false) the pages are float32 from the load on: half the
    # registers of the held slice, and no float64 instruction anywhere but on the row's few scalars.
    DT: tl.constexpr = tl.float64 if FINE64 else tl.float32

    # The bracket and the start: maxima over the row's live pages.
    if HELD:  # the slice is one block (and a tail), kept in registers with its τ-independent terms
        m0, s0, c0, w, live = _load_block(m_row, s_row, n_row, c_row, offs, end, HAS_CAP, DT)
        lo_p, hi_p, top_p = _bracket(m0, s0, c0, live)
        if FINE64:
            b, sq_b, lin_b = _cap_terms(m0, s0, c0, False)
        b32, sq_b32, lin_b32 = _cap_terms(m0.to(tl.float32), s0.to(tl.float32), c0.to(tl.float32), True)
        if TAIL > 0:
            t_m0, t_s0, t_c0, t_w, t_live = _load_block(m_row, s_row, n_row, c_row, first + BLOCK_P + tl.arange(0, TAIL),
                                                        end, HAS_CAP, DT)
            lo_t, hi_t, top_t = _bracket(t_m0, t_s0, t_c0, t_live)
            lo_p, hi_p, top_p = tl.maximum(lo_p, lo_t), tl.maximum(hi_p, hi_t), tl.maximum(top_p, top_t)
            if FINE64:
                t_b, t_sq_b, t_lin_b = _cap_terms(t_m0, t_s0, t_c0, False)
            t_b32, t_sq_b32, t_lin_b32 = _cap_terms(t_m0.to(tl.float32), t_s0.to(tl.float32), t_c0.to(tl.float32), True)
    else:
        lo_p, hi_p, top_p = neg, neg, neg
        for p0 in range(first, end, BLOCK_P):
            m0, s0, c0, w, live = _load_block(m_row, s_row, n_row, c_row, p0 + tl.arange(0, BLOCK_P), end, HAS_CAP, DT)
            lo_b, hi_b, top_b = _bracket(m0, s0, c0, live)
            lo_p = tl.maximum(lo_p, lo_b.to(tl.float64))
            hi_p = tl.maximum(hi_p, hi_b.to(tl.float64))
            top_p = tl.maximum(top_p, top_b.to(tl.float64))
    los, his, tops, mine = _exchange(parts, ctr, lo_p.to(tl.float64), hi_p.to(tl.float64), top_p.to(tl.float64), 0,
                                     S_PAD)
    lo = tl.max(tl.where(mine, los, float("-inf")), 0)
    empty = lo == float("-inf")
    lo = tl.where(empty, 0.0, lo - 1.0)
    hi = tl.where(empty, 1.0, tl.maximum(tl.max(tl.where(mine, his, float("-inf")), 0), lo))
    tau = tl.where(empty, 0.0, tl.max(tl.where(mine, tops, float("-inf")), 0))
    tau = tl.minimum(tl.maximum(tau, lo), hi)

    # The float32 steps, then the float64 ones from their iterate inside the float64 bracket; each
    # precision's steps end early after one that barely moved τ (`reference.STOP_FLOAT32`,
    # `STOP_FLOAT64`). Every program of the row adds the same partials in the same order, so all
    # take the same steps and meet at the same barriers.
    tau32, lo32, hi32 = tau.to(tl.float32), lo.to(tl.float32), hi.to(tl.float32)
    k = tl.zeros((), tl.int32)  # steps taken: the barriers passed after the bracket's
    moving = coarse > 0
    while moving:
        if HELD:  # float32 copies made per step: registers are what the held slice is short of
            f_p, l_p = _step_sums(m0.to(tl.float32), s0.to(tl.float32), c0.to(tl.float32), w.to(tl.float32), b32,
                                  sq_b32, lin_b32, tau32, True)
            if TAIL > 0:
                f_t, l_t = _step_sums(t_m0.to(tl.float32), t_s0.to(tl.float32), t_c0.to(tl.float32), t_w.to(tl.float32),
                                      t_b32, t_sq_b32, t_lin_b32, tau32, True)
                f_p, l_p = f_p + f_t, l_p + l_t
        else:
            f_p, l_p = tl.zeros((), tl.float32), tl.zeros((), tl.float32)
            for p0 in range(first, end, BLOCK_P):
                m0, s0, c0, w, live = _load_block(m_row, s_row, n_row, c_row, p0 + tl.arange(0, BLOCK_P), end, HAS_CAP,
                                                  DT)
                m32, s32, c32, w32 = m0.to(tl.float32), s0.to(tl.float32), c0.to(tl.float32), w.to(tl.float32)
                b32, sq_b32, lin_b32 = _cap_terms(m32, s32, c32, True)
                f_b, l_b = _step_sums(m32, s32, c32, w32, b32, sq_b32, lin_b32, tau32, True)
                f_p, l_p = f_p + f_b, l_p + l_b
        k += 1
        fs, ls, _, _ = _exchange(parts, ctr, f_p.to(tl.float64), l_p.to(tl.float64), neg, k, S_PAD)
        step32, lo32, hi32 = _newton(tau32, lo32, hi32, tl.sum(fs, 0).to(tl.float32), tl.sum(ls, 0).to(tl.float32),
                                     1e-30)
        moving = (k < coarse) & (tl.abs(step32 - tau32) > STOP_FLOAT32 * (1.0 + tl.abs(tau32)))
        tau32 = step32
    if coarse > 0:
        tau = tl.minimum(tl.maximum(tau32.to(tl.float64), lo), hi)
    if FINE64:
        fine_end = k + fine
        moving = fine > 0
        while moving:
            if HELD:
                f_p, l_p = _step_sums(m0, s0, c0, w, b, sq_b, lin_b, tau, False)
                if TAIL > 0:
                    f_t, l_t = _step_sums(t_m0, t_s0, t_c0, t_w, t_b, t_sq_b, t_lin_b, tau, False)
                    f_p, l_p = f_p + f_t, l_p + l_t
            else:
                f_p, l_p = tl.zeros((), tl.float64), tl.zeros((), tl.float64)
                for p0 in range(first, end, BLOCK_P):
                    m0, s0, c0, w, live = _load_block(m_row, s_row, n_row, c_row, p0 + tl.arange(0, BLOCK_P), end,
                                                      HAS_CAP, DT)
                    b, sq_b, lin_b = _cap_terms(m0, s0, c0, False)
                    f_b, l_b = _step_sums(m0, s0, c0, w, b, sq_b, lin_b, tau, False)
                    f_p, l_p = f_p + f_b, l_p + l_b
            k += 1
            fs, ls, _, _ = _exchange(parts, ctr, f_p, l_p, neg, k, S_PAD)
            step, lo, hi = _newton(tau, lo, hi, tl.sum(fs, 0), tl.sum(ls, 0), _f64(1e-300))
            moving = (k < fine_end) & (tl.abs(step - tau) > _f64(STOP_FLOAT64) * (1.0 + tl.abs(tau)))
            tau = step
    if me == 0:
        tl.store(out_ptr + row, tl.where(empty, float("-inf"), tau))
    # The last program of the row out zeroes its counters (every program has passed every barrier).
    tl.debug_barrier()
    if tl.atomic_add(ctr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(ctr + tl.arange(0, 2), tl.zeros((2,), tl.int32))


def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None, iters: int, float64_steps: int,
                              counters: Tensor, plan_for) -> Tensor:
    """``float64[..., 1]``: `reference.gaussian_entmax_threshold` of ``m, s, n, cap [..., P]`` (broadcast
    together; any float dtype, ``n`` also integer) with ``iters`` steps, at most ``float64_steps`` of
    them in float64, ``-inf`` for rows without a live page.
    ``counters``: ``COUNTERS`` zeroed int32 per row, left zero. ``plan_for(P, rows, device)``: the
    `EntmaxThresholdConfig` for rows of ``P`` pages (its ``split`` settled) and the pages of the tail
    block that holds a slice past ``block_p`` (0: none needed; None: the slice is walked instead)."""
    route.check_device(m)
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if float64_steps < 0:
        raise ValueError(f"float64_steps must be >= 0, got {float64_steps}")
    tensors = (m, s, n) if cap is None else (m, s, n, cap)
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if len(shape) == 0:
        raise ValueError("expected inputs with a last (page) dim, got 0-dim tensors")
    p = shape[-1]
    r = math.prod(shape[:-1])
    out = _alloc(*shape[:-1], 1, dtype=torch.float64, device=m.device)
    if r == 0:
        return out
    # Rows of P contiguous pages (an expanded n, e.g. page counts shared by the heads, is copied).
    m, s, n = (t.expand(shape).contiguous().view(r, p) for t in (m, s, n))
    c = m if cap is None else cap.expand(shape).contiguous().view(r, p)  # c: a dummy without caps
    cfg, tail = plan_for(p, r, m.device)
    per_program = triton.cdiv(p, cfg.split)
    s_pad = max(16, triton.next_power_of_2(cfg.split))
    parts = _alloc(r * 2 * s_pad * 4, dtype=torch.float64, device=m.device)
    fine = min(iters, float64_steps)
    _entmax_threshold_kernel[(cfg.split, r)](
        m, s, n, c, out, parts, counters, p, per_program, iters - fine, fine,
        HAS_CAP=cap is not None, BLOCK_P=cfg.block_p, HELD=tail is not None, TAIL=tail or 0, S_PAD=s_pad,
        FINE64=fine > 0, num_warps=cfg.num_warps,
    )
    return out
