"""The pooled Gaussian entmax threshold's specification (`EntmaxKV`'s τ̂), and the censored Gaussian
moments it is built on, in plain torch."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_SQRT_2PI = math.sqrt(2.0 * math.pi)


def gaussian_relu_sq(c: Tensor, s: Tensor) -> Tensor:
    """``E[(X)_+²]`` for ``X ~ N(c, s²)`` (``s = 0`` gives ``max(c, 0)²``)."""
    a = c / s.clamp(min=1e-30)
    phi = torch.exp(-0.5 * a * a) / _SQRT_2PI
    return (c * c + s * s) * torch.special.ndtr(a) + c * s * phi


def gaussian_relu(c: Tensor, s: Tensor) -> Tensor:
    """``E[(X)_+]`` for ``X ~ N(c, s²)``."""
    a = c / s.clamp(min=1e-30)
    return c * torch.special.ndtr(a) + s * torch.exp(-0.5 * a * a) / _SQRT_2PI


def censored_relu_sq(m: Tensor, s: Tensor, cap: Tensor, tau: Tensor) -> Tensor:
    """``E[(min(X, cap) − τ)_+²]`` for ``X ~ N(m, s²)``: the Gaussian censored at a hard bound.

    For ``τ < cap`` it is ``E[(X−τ)_+²] − E[(X−cap)_+²] − 2(cap−τ)·E[(X−cap)_+]``, else 0.
    """
    return _censored_moments(m, s, cap, tau)[0]


def _censored_moments(m: Tensor, s: Tensor, cap: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """``(E[(min(X, cap) − τ)_+²], E[(min(X, cap) − τ)_+])`` for ``X ~ N(m, s²)``."""
    finite = torch.isfinite(cap)
    b = torch.where(finite, cap, m)  # an infinite cap censors nothing (and must not make NaNs)
    sq = gaussian_relu_sq(m - tau, s)
    lin = gaussian_relu(m - tau, s)
    lin_b = torch.where(finite, gaussian_relu(m - b, s), 0.0)
    over_sq = torch.where(finite, gaussian_relu_sq(m - b, s) + 2 * (b - tau) * lin_b, 0.0)
    below = tau < cap
    return (
        torch.where(below, (sq - over_sq).clamp(min=0), 0.0),
        torch.where(below, (lin - lin_b).clamp(min=0), 0.0),
    )


def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None = None, iters: int = 12) -> Tensor:
    """Solve ``f(τ) = Σ_p n_p·E[(min(x_p, cap_p) − τ)_+²] − 1 = 0`` for ``x_p ~ N(m_p, s_p²)`` along
    the last dim.

    ``m, s [..., P]`` (``m = -inf`` or ``n = 0`` for pages not in the pool), ``n [..., P]`` token
    counts, ``cap [..., P]`` hard upper bounds of the scores (``None``: no bound) → ``τ̂ [..., 1]``
    (``-inf`` for an empty pool). With caps, ``τ̂ < max_p cap_p``.

    ``f`` is convex and decreasing, ``f' = −2·Σ_p n_p·E[(min(x_p, cap_p) − τ)_+]``, so Newton's
    method converges monotonically once it is left of the root, and a step from the right lands
    left of it. It starts at ``max_p m_p`` inside the bracket
    ``[max_p (m_p − 8·s_p) − 1, max_p min(m_p + 8·s_p, cap_p)]`` (``f ≥ 0`` at the left end: that
    page alone holds a unit of mass), which every evaluation narrows; steps are clamped into the
    bracket (a flat far-right start jumps to its left end, from where Newton climbs). ``iters``
    steps in float64, each one pass over the pages: 12 reach ~1e-12 on pools of up to 8K pages
    with logits spread over ±60 (and are exact on point masses, ``s = 0``).

    The pooled threshold of `kv.EntmaxKV`; the Triton kernel is ``kernel.py``, beside this file.
    """
    m, s, n = m.double(), s.double(), n.double()
    live = (n > 0) & (m > -torch.inf)
    m0 = torch.where(live, m, 0.0)
    s0 = torch.where(live, s, 0.0)
    c0 = torch.full_like(m0, torch.inf) if cap is None else torch.where(live, cap.double(), torch.inf)
    c0 = torch.maximum(c0, m0)  # a mean is never above the bound (guards float rounding)
    lo = torch.where(live, m0 - 8.0 * s0, -torch.inf).amax(-1, keepdim=True)
    empty = lo == -torch.inf
    lo = torch.where(empty, 0.0, lo - 1.0)
    hi = torch.where(live, torch.minimum(m0 + 8.0 * s0, c0), -torch.inf).amax(-1, keepdim=True)
    hi = torch.where(empty, 1.0, torch.maximum(hi, lo))
    w = torch.where(live, n, 0.0)
    # Start at the largest mean: a start right of the root is fine too (the tangent of a convex
    # decreasing function crosses zero left of its root), and this one is usually close.
    tau = torch.where(empty, 0.0, torch.where(live, m0, -torch.inf).amax(-1, keepdim=True)).clamp(lo, hi)
    for _ in range(iters):
        sq, lin = _censored_moments(m0, s0, c0, tau)
        f = (w * sq).sum(-1, keepdim=True) - 1.0
        slope = 2.0 * (w * lin).sum(-1, keepdim=True)
        lo = torch.where(f >= 0, tau, lo)
        hi = torch.where(f >= 0, hi, tau)
        step = tau + f / slope.clamp(min=1e-300)
        tau = torch.minimum(torch.maximum(step, lo), hi)
    return torch.where(empty, -torch.inf, tau)

