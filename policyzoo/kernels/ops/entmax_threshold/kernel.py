"""Pooled Gaussian entmax threshold (Triton); spec: `reference.gaussian_entmax_threshold`,
beside this file.

`EntmaxKV` (``mode="gaussian"``) solves, per row of ``[B, H]`` pages, the entmax normaliser of a pool
of censored Gaussians: ``f(τ) = Σ_p n_p·E[(min(x_p, cap_p) − τ)_+²] − 1 = 0``, ``x_p ~ N(m_p, s_p²)``,
by a safeguarded Newton iteration in float64 (``iters`` steps, each a full pass over the pages). The
torch reference is a chain of elementwise ops and last-dim sums; under `torch.compile` Inductor fuses
it into one persistent reduction over all pages, which Triton 3.6 fails to compile for 8192 pages (a
128K context; ``PassManager::run failed`` in make_ttgir). This kernel is the same algorithm as one
opaque custom op (``policyzoo::gaussian_entmax_threshold``), so Inductor never generates that
reduction.

One program per row (the leading dims flattened); the row is walked in blocks of pages per pass
(the `EntmaxThresholdConfig` the op chose for the call, `entmax_threshold_config`), so any number of
pages works:

1. one pass for the bracket and the start: ``lo = max_p (m_p − 8·s_p) − 1``,
   ``hi = max(max_p min(m_p + 8·s_p, cap_p), lo)``, ``τ₀ = clamp(max_p m_p, lo, hi)`` over the live
   pages (``n_p > 0`` and ``m_p > -inf``); no live page: ``τ̂ = -inf``;
2. ``iters`` passes, each accumulating ``f(τ)`` and the slope ``−f'(τ)`` blockwise, then the
   reference's bracket update and clamped Newton step.

Everything is float64 (inputs of any float or integer dtype are converted on load). ``Φ(a)`` is
``0.5·(1 + erf(a/√2))`` (`tl.erf`): torch's ``ndtr`` uses ``erfc`` in the tails, and the difference is
an absolute ~1e-16 in ``Φ``, which moves ``τ̂`` by at most ~1e-11 (relative) on pools of 8K pages
with logits and spreads up to ±60. Constants that a float32 literal would round (``1/√2``) are built
as float64 tensors.

The reduction order differs from torch's, so results agree with the reference to ~1e-12, not bit
for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The output comes from here (uninitialised; the tests poison it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _f64(x):
    """A float64 constant (a Python float literal in a kernel is a float32 constant)."""
    return tl.full((), x, tl.float64)


@triton.jit
def _relu_moments(c, s):
    """``(E[(X)_+²], E[(X)_+])`` for ``X ~ N(c, s²)`` (`reference.gaussian_relu_sq`, `gaussian_relu`)."""
    a = c / tl.maximum(s, _f64(1e-30))
    phi = tl.exp(-0.5 * a * a) / _f64(2.5066282746310002)  # √(2π)
    cdf = 0.5 * (1.0 + tl.erf(a * _f64(0.7071067811865476)))  # Φ(a), 1/√2
    return (c * c + s * s) * cdf + c * s * phi, c * cdf + s * phi


@triton.jit
def _censored_moments(m, s, cap, tau):
    """``(E[(min(X, cap) − τ)_+²], E[(min(X, cap) − τ)_+])`` for ``X ~ N(m, s²)``
    (`reference._censored_moments`); ``cap = +inf`` censors nothing."""
    finite = tl.abs(cap) < float("inf")
    b = tl.where(finite, cap, m)
    sq, lin = _relu_moments(m - tau, s)
    sq_b, lin_b = _relu_moments(m - b, s)
    lin_b = tl.where(finite, lin_b, 0.0)
    over_sq = tl.where(finite, sq_b + 2.0 * (b - tau) * lin_b, 0.0)
    below = tau < cap
    return (
        tl.where(below, tl.maximum(sq - over_sq, 0.0), 0.0),
        tl.where(below, tl.maximum(lin - lin_b, 0.0), 0.0),
    )


@triton.jit
def _load_block(m_row, s_row, n_row, c_row, offs, P, HAS_CAP: tl.constexpr):
    """One block of pages as float64 ``(m, s, cap, w, live, inside)``, masked like the reference:
    pages not in the pool (and lanes past ``P``) get ``m = s = 0``, ``cap = +inf``, ``w = 0``."""
    inside = offs < P
    m = tl.load(m_row + offs, mask=inside, other=float("-inf")).to(tl.float64)
    s = tl.load(s_row + offs, mask=inside, other=0.0).to(tl.float64)
    n = tl.load(n_row + offs, mask=inside, other=0).to(tl.float64)
    live = inside & (n > 0.0) & (m > float("-inf"))
    m0 = tl.where(live, m, 0.0)
    s0 = tl.where(live, s, 0.0)
    if HAS_CAP:
        c = tl.load(c_row + offs, mask=inside, other=float("inf")).to(tl.float64)
        c0 = tl.where(live, c, float("inf"))
    else:
        c0 = tl.full(offs.shape, float("inf"), tl.float64)
    c0 = tl.maximum(c0, m0)  # a mean is never above the bound (guards float rounding)
    w = tl.where(live, n, 0.0)
    return m0, s0, c0, w, live, inside


@triton.jit
def _entmax_threshold_kernel(
    m_ptr, s_ptr, n_ptr, c_ptr, out_ptr,
    P, iters,
    HAS_CAP: tl.constexpr, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m_row = m_ptr + row * P
    s_row = s_ptr + row * P
    n_row = n_ptr + row * P
    c_row = c_ptr + row * P
    offs = tl.arange(0, BLOCK_P)
    neg_inf = tl.full((BLOCK_P,), float("-inf"), tl.float64)

    # Pass 0: the bracket and the start (maxima over the live pages).
    lo_acc = neg_inf
    hi_acc = neg_inf
    top_acc = neg_inf
    for p0 in range(0, P, BLOCK_P):
        m0, s0, c0, w, live, inside = _load_block(m_row, s_row, n_row, c_row, p0 + offs, P, HAS_CAP)
        lo_acc = tl.maximum(lo_acc, tl.where(live, m0 - 8.0 * s0, float("-inf")))
        hi_acc = tl.maximum(hi_acc, tl.where(live, tl.minimum(m0 + 8.0 * s0, c0), float("-inf")))
        top_acc = tl.maximum(top_acc, tl.where(live, m0, float("-inf")))
    lo = tl.max(lo_acc, axis=0)
    empty = lo == float("-inf")
    lo = tl.where(empty, 0.0, lo - 1.0)
    hi = tl.max(hi_acc, axis=0)
    hi = tl.where(empty, 1.0, tl.maximum(hi, lo))
    tau = tl.where(empty, 0.0, tl.max(top_acc, axis=0))
    tau = tl.minimum(tl.maximum(tau, lo), hi)

    # Newton passes: f(τ) and the slope −f'(τ) in one walk over the pages each.
    for _ in range(iters):
        f_acc = tl.zeros((BLOCK_P,), tl.float64)
        g_acc = tl.zeros((BLOCK_P,), tl.float64)
        for p0 in range(0, P, BLOCK_P):
            m0, s0, c0, w, live, inside = _load_block(m_row, s_row, n_row, c_row, p0 + offs, P, HAS_CAP)
            sq, lin = _censored_moments(m0, s0, c0, tau)
            f_acc += tl.where(inside, w * sq, 0.0)
            g_acc += tl.where(inside, w * lin, 0.0)
        f = tl.sum(f_acc, axis=0) - 1.0
        slope = 2.0 * tl.sum(g_acc, axis=0)
        right = f >= 0.0  # τ is left of the root (f decreasing)
        lo = tl.where(right, tau, lo)
        hi = tl.where(right, hi, tau)
        step = tau + f / tl.maximum(slope, _f64(1e-300))
        tau = tl.minimum(tl.maximum(step, lo), hi)
    tl.store(out_ptr + row, tl.where(empty, float("-inf"), tau))


def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None, iters: int, config_for) -> Tensor:
    """``float64[..., 1]``: `reference.gaussian_entmax_threshold` of ``m, s, n, cap [..., P]`` (broadcast
    together; any float dtype, ``n`` also integer), ``-inf`` for rows without a live page. ``config_for``:
    the rule that gives the `EntmaxThresholdConfig` for rows of ``P`` pages."""
    route.check_device(m)
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
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
    cfg = config_for(p)
    _entmax_threshold_kernel[(r,)](
        m, s, n, c, out, p, int(iters),
        HAS_CAP=cap is not None, BLOCK_P=cfg.block_p, num_warps=cfg.num_warps,
    )
    return out
