"""`EntmaxKV`: support-aware page selection for α-entmax (and softmax) attention.

α-entmax (α = 1.5) gives exact zeros: ``p_i = [z_i/2 − τ]_+²`` with ``Σ p_i = 1`` (``z = scale·q·k``).
If the selected pages contain the support ``{i : z_i/2 > τ}``, sparse entmax over them is *exact*
(the threshold over a superset of the support is the same τ). The policy scores pages from the cache
summaries only (no key is read):

- the Quest bound ``u_p = scale·Σ_d max(q_d·min_{p,d}, q_d·max_{p,d}) ≥ z_i`` for every token of
  page ``p`` (`page_bound_scores`);
- a Gaussian model of the page's scores: ``μ_p = scale·q·mean_p``,
  ``σ_p² = Σ_d (scale·q_d)²·std_{p,d}²`` (dimensions treated as independent).

``mode="gaussian"``: pool the pages into a score distribution (page ``p`` weighs its ``n_p`` visible
tokens, ``x = z/2 ~ N(m_p = μ_p/2, s_p² = σ_p²/4)`` censored at the hard bound ``b_p = u_p/2``) and
solve the entmax normaliser of the pool, ``Σ_p n_p·E[(min(x, b_p) − τ̂)_+²] = 1`` (safeguarded
Newton, `gaussian_entmax_threshold`), with ``E[(x − τ)_+²] = (c² + s²)·Φ(c/s) + c·s·φ(c/s)``
(``c = m − τ``) and the censoring correction ``− E[(x − b)_+²] − 2(b − τ)·E[(x − b)_+]`` for
``τ < b`` (0 for ``τ ≥ b``). Censoring keeps Gaussian tails from claiming scores no key of the
page can reach (and keeps ``τ̂ < max_p b_p``). Page ``p`` is a candidate when its upper quantile
can clear the threshold: ``min(μ_p/2 + z·σ_p/2, u_p/2) > τ̂`` (``z`` standard deviations of the
page's score model, capped by the hard Quest bound).
Per KV head, a page is a candidate if it is one for any query head of the group (the margins
``min(...) − τ̂_h`` are folded by their max), candidates are ranked by that margin, and at most
``budget`` pages are kept (the budget is a cap: the count adapts to the score distribution), plus the
forced pages (sinks, window, and always the last page).

``mode="topk"``: the top ``budget`` pages by Quest bound (the same choice as `Quest`).

``attention`` says which attention the model uses: ``"entmax"`` routes the decode step to the
kernel's 1.5-entmax mode (`kernels.reference.decode_attention_entmax15`), ``"softmax"`` to the usual
softmax kernel. The selector is the same; in softmax mode the Gaussian rule keeps the pages that may
hold the α-entmax support of the logits — the top of the score distribution — so for diffuse softmax
heads ``mode="topk"`` (a fixed budget) is the safer choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..selection import Selection
from .base import Budget, KVSelector, KVState, aggregate_groups, check_count, choose_topk, forced_pages, group_page_bounds, page_bound_scores, page_budget

_SQRT_2PI = math.sqrt(2.0 * math.pi)


def page_gaussians(state: KVState, q: Tensor) -> tuple[Tensor, Tensor]:
    """Per query head and page, the Gaussian model of ``scale·q·k``: ``(μ, σ) float32[B, H, P]``."""
    b, h, d = q.shape
    mean, std = state.cache.page_mean[state.layer], state.cache.page_std[state.layer]
    h_kv = mean.shape[1]
    qs = q.float().view(b, h_kv, h // h_kv, d) * state.scale
    mu = torch.einsum("bkgd,bkpd->bkgp", qs, mean)
    var = torch.einsum("bkgd,bkpd->bkgp", qs * qs, std * std)
    return mu.reshape(b, h, -1), var.clamp(min=0).sqrt().reshape(b, h, -1)


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


@dataclass
class EntmaxKV(KVSelector):
    """Support-aware page selection; see the module docstring for the exact rule.

    Args:
        budget: page cap in tokens (``ceil(budget / page)`` pages) or a keep ratio of visible pages.
        alpha: the entmax α; only 1.5 (the kernel's entmax mode) is supported.
        mode: ``"gaussian"`` (adaptive count under the cap) or ``"topk"`` (top pages by bound).
        attention: ``"softmax"`` or ``"entmax"``; the attention function routes on this attribute.
        page: the cache page size this policy needs.
        sinks, window: tokens whose pages are always kept; the last page is always kept.
        z: standard deviations of the upper quantile of a page's Gaussian score model.
        iters: Newton steps of the threshold estimate (`gaussian_entmax_threshold`).
    """

    budget: int | float = 0.25
    alpha: float = 1.5
    mode: Literal["gaussian", "topk"] = "gaussian"
    attention: Literal["softmax", "entmax"] = "softmax"
    page: int = 16
    sinks: int = 4
    window: int = 16
    z: float = 3.0
    iters: int = 12

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        if self.alpha != 1.5:
            raise ValueError(f"alpha must be 1.5 (the only α the entmax kernel implements), got {self.alpha!r}")
        if self.mode not in ("gaussian", "topk"):
            raise ValueError(f"mode must be 'gaussian' or 'topk', got {self.mode!r}")
        if self.attention not in ("softmax", "entmax"):
            raise ValueError(f"attention must be 'softmax' or 'entmax', got {self.attention!r}")
        check_count(self.page, "page", minimum=1)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not math.isfinite(self.z):
            raise ValueError(f"z must be a finite number, got {self.z!r}")
        check_count(self.iters, "iters", minimum=1)

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.page

    def page_scores(self, state: KVState, q: Tensor) -> Tensor:
        """``float32[B, H_kv, P]`` ranking scores (``-inf`` on pages without visible tokens).

        ``"topk"``: the group max of the Quest bound. ``"gaussian"``: the group max of the margin
        ``min(μ_p/2 + z·σ_p/2, u_p/2) − τ̂_h``; a page is a candidate iff its margin is positive.
        """
        if self.mode == "topk":
            return group_page_bounds(state, q)
        valid = state.page_valid()
        h_kv = state.keys.shape[1]
        bound = page_bound_scores(state, q)  # [B, H, P]
        mu, sigma = page_gaussians(state, q)
        counts = state.cache.page_counts()[:, None, :].expand_as(mu)
        m = torch.where(valid[:, None, :], mu * 0.5, -torch.inf)
        tau = gaussian_entmax_threshold(m, sigma * 0.5, counts, 0.5 * bound, self.iters).float()
        upper = torch.minimum(0.5 * (mu + self.z * sigma), 0.5 * bound)
        margin = torch.where(torch.isfinite(tau), upper - tau, torch.inf)
        return aggregate_groups(margin, valid, h_kv, "max")

    def select(self, state: KVState, q: Tensor) -> Selection:
        k_max, count = page_budget(state, self._budget, self.page, self.sinks, self.window, "EntmaxKV")
        valid = state.page_valid()
        scores = self.page_scores(state, q)
        forced = forced_pages(state, self.sinks, self.window)
        if self.mode == "gaussian":
            # Keep forced ∪ candidates (positive margins), the best of them under the cap.
            f = forced[:, None, :] & valid[:, None, :]
            count = torch.minimum(count[:, None], (f | (scores > 0)).sum(-1))  # per KV head
        return choose_topk(scores, forced, k_max, count, block=self.page)
