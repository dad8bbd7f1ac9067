"""The pooled Gaussian entmax threshold's specification (`EntmaxKV`'s τ̂), and the censored Gaussian
moments it is built on, in plain torch."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_SQRT_2PI = math.sqrt(2.0 * math.pi)


def normal_cdf(a: Tensor) -> Tensor:
    """``Φ(a)`` in ``a``'s dtype, to that dtype's relative precision in the lower tail too.

    torch's float32 ``ndtr`` on the CPU is ``(1 + erf)/2``, which keeps only absolute precision:
    ``Φ(−5.5)`` comes out 57% high and ``Φ(−8)`` as 0. The moments below multiply ``Φ`` by
    ``c² + s²`` and subtract a term of the same size, so a page deep in the tail would add ±1e-4 of
    noise to the pooled sums and float32 Newton steps would miss the root by 1e-3 relative. Below
    float64, ``Φ`` is therefore the float64 value rounded (the kernel's float32 ``Φ`` is a formula
    of 1.2e-7 relative error, ``kernel._normal_cdf32``)."""
    if a.dtype == torch.float64:
        return torch.special.ndtr(a)
    return torch.special.ndtr(a.double()).to(a.dtype)


def gaussian_relu_sq(c: Tensor, s: Tensor) -> Tensor:
    """``E[(X)_+²]`` for ``X ~ N(c, s²)`` (``s = 0`` gives ``max(c, 0)²``)."""
    a = c / s.clamp(min=1e-30)
    phi = torch.exp(-0.5 * a * a) / _SQRT_2PI
    return (c * c + s * s) * normal_cdf(a) + c * s * phi


def gaussian_relu(c: Tensor, s: Tensor) -> Tensor:
    """``E[(X)_+]`` for ``X ~ N(c, s²)``."""
    a = c / s.clamp(min=1e-30)
    return c * normal_cdf(a) + s * torch.exp(-0.5 * a * a) / _SQRT_2PI


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


# Newton steps of `gaussian_entmax_threshold` taken in float64 by default, after the others in
# float32: three from the float32 iterate (within ~1e-5 of the pool's scale of the root, where
# float32's moments cancel) bring it to float64 precision.
FINE_STEPS = 3
# A row stops stepping in a precision once a step moved τ by at most this times ``1 + |τ|``. In
# float32 the iterate then sits at float32's floor (its steps only shake by its rounding), which is
# what the float64 steps start from; in float64 a step that short leaves about its square (Newton
# converges quadratically near the root): ~1e-12 of the root. Typical pools stop after 4-6 float32
# steps and 2 float64 ones, where the full count is 9 and 3 (each a pass over the pages and, on a
# GPU, a barrier of the row's programs).
STOP_FLOAT32 = 1e-5
STOP_FLOAT64 = 1e-6


def pool_scale(m: Tensor, s: Tensor) -> Tensor:
    """``float64[..., 1]``: ``1 + max_p (|m_p| + s_p)`` over the pool's pages (``m = -inf``: not in
    it), the unit in which the float32 steps' distance from the root is stated (about 1e-5)."""
    m, s = m.double(), s.double()
    return 1 + torch.where(m > -torch.inf, m.abs() + s, 0.0).amax(-1, keepdim=True)


def newton_step(m0: Tensor, s0: Tensor, c0: Tensor, w: Tensor, tau: Tensor, lo: Tensor, hi: Tensor,
                tiny: float) -> tuple[Tensor, Tensor, Tensor]:
    """One safeguarded Newton step of ``g(τ) = √F(τ) − 1``, ``F(τ) = Σ_p w_p·E[(min(x_p, c_p) − τ)_+²]``,
    in the dtype of its arguments: ``(τ', lo', hi')``; ``tiny`` floors the slope's sum.

    ``F' = −2L`` with ``L = Σ_p w_p·E[(min(x_p, c_p) − τ)_+]``, so the step is ``τ + (F − √F)/L``; where
    ``F = 0`` (no mass above τ) it goes to the bracket's left end."""
    sq, lin = _censored_moments(m0, s0, c0, tau)
    big_f = (w * sq).sum(-1, keepdim=True)
    big_l = (w * lin).sum(-1, keepdim=True)
    lo = torch.where(big_f >= 1.0, tau, lo)
    hi = torch.where(big_f >= 1.0, hi, tau)
    step = torch.where(big_f > 0, tau + (big_f - big_f.sqrt()) / big_l.clamp(min=tiny), -torch.inf)
    return torch.minimum(torch.maximum(step, lo), hi), lo, hi


def gaussian_entmax_threshold(m: Tensor, s: Tensor, n: Tensor, cap: Tensor | None = None, iters: int = 12,
                              float64_steps: int = FINE_STEPS) -> Tensor:
    """Solve ``F(τ) = Σ_p n_p·E[(min(x_p, cap_p) − τ)_+²] = 1`` for ``x_p ~ N(m_p, s_p²)`` along the
    last dim.

    ``m, s [..., P]`` (``m = -inf`` or ``n = 0`` for pages not in the pool), ``n [..., P]`` token
    counts, ``cap [..., P]`` hard upper bounds of the scores (``None``: no bound) → ``τ̂ [..., 1]``
    (float64; ``-inf`` for an empty pool). With caps, ``τ̂ < max_p cap_p``.

    ``√F`` is the weighted L2 norm of ``(min(x, cap) − τ)_+`` over the pool, a norm of functions
    convex and decreasing in τ, so ``g = √F − 1`` is convex and decreasing: Newton's method on it
    (`newton_step`) converges monotonically once it is left of the root, and a step from the right
    lands left of it. ``g`` is much closer to linear than ``F − 1`` (exactly linear on one point
    mass), so far from the root its steps are long: 8 steps where ``F − 1`` took over 12 on pools
    spread over ±60. It starts at ``max_p m_p`` inside the bracket
    ``[max_p (m_p − 8·s_p) − 1, max_p min(m_p + 8·s_p, cap_p)]`` (``F ≥ 1`` at the left end: that
    page alone holds a unit of mass), which every evaluation narrows; steps are clamped into the
    bracket.

    At most ``iters`` steps, each one pass over the pages: up to ``iters − float64_steps`` in
    float32, then up to ``float64_steps`` (or all, if fewer) in float64 from the float32 iterate,
    inside the float64 bracket (the float32 steps' own bracket may be off by their rounding). Near
    the root each step squares the error, so the float64 steps remove the float32 steps' rounding
    (and a float32 pass costs a fraction of a float64 one on a GPU). A row leaves a precision's
    steps after one that moved τ by at most `STOP_FLOAT32` (float32) or `STOP_FLOAT64` (float64)
    times ``1 + |τ|``; the float64 steps always take one. With the default `FINE_STEPS`, 12 steps
    reach ~1e-11 on pools of up to 8K pages with logits spread over ±60, and are exact on point
    masses (``s = 0``); with ``float64_steps=0`` every step is float32 and τ̂ is within about 1e-5
    of the pool's scale (`pool_scale`) of that root (the float32 steps' early stop and rounding).

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
    if float64_steps < 0:
        raise ValueError(f"float64_steps must be >= 0, got {float64_steps}")
    fine = min(iters, float64_steps)
    if iters > fine:
        pool = tuple(t.float() for t in (m0, s0, c0, w))
        tau32, lo32, hi32 = tau.float(), lo.float(), hi.float()
        done = torch.zeros_like(tau32, dtype=torch.bool)
        for _ in range(iters - fine):
            tau32, lo32, hi32, done = _stepped(newton_step(*pool, tau32, lo32, hi32, 1e-30), tau32, lo32, hi32, done,
                                               STOP_FLOAT32)
        tau = torch.minimum(torch.maximum(tau32.double(), lo), hi)
    done = torch.zeros_like(tau, dtype=torch.bool)
    for _ in range(fine):
        tau, lo, hi, done = _stepped(newton_step(m0, s0, c0, w, tau, lo, hi, 1e-300), tau, lo, hi, done, STOP_FLOAT64)
    return torch.where(empty, -torch.inf, tau)


def _stepped(step: tuple[Tensor, Tensor, Tensor], tau: Tensor, lo: Tensor, hi: Tensor, done: Tensor,
             stop: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows' state after a Newton ``step`` (its ``(τ', lo', hi')``): rows already ``done`` keep
    theirs; a row whose step moved τ by at most ``stop·(1 + |τ|)`` is done from now on."""
    new_tau, new_lo, new_hi = step
    short = (new_tau - tau).abs() <= stop * (1.0 + tau.abs())
    keep = lambda old, new: torch.where(done, old, new)  # noqa: E731
    return keep(tau, new_tau), keep(lo, new_lo), keep(hi, new_hi), done | short
