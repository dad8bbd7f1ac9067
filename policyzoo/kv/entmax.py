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
Newton, `gaussian_entmax_threshold`; on Triton one kernel, ``kernels/ops/entmax_threshold/kernel.py``), with
``E[(x − τ)_+²] = (c² + s²)·Φ(c/s) + c·s·φ(c/s)`` (``c = m − τ``) and the censoring correction
``− E[(x − b)_+²] − 2(b − τ)·E[(x − b)_+]`` for ``τ < b`` (0 for ``τ ≥ b``). Censoring keeps
Gaussian tails from claiming scores no key of the page can reach (and keeps ``τ̂ < max_p b_p``).
Page ``p`` is a candidate when its upper quantile can clear the threshold:
``min(μ_p/2 + z·σ_p/2, u_p/2) > τ̂`` (``z`` standard deviations of the page's score model, capped by
the hard Quest bound).
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

from .. import kernels
from ..kernels.reference import (  # noqa: F401  (re-exported: the references live beside their kernel)
    censored_relu_sq,
    gaussian_entmax_threshold,
    gaussian_relu,
    gaussian_relu_sq,
)
from ..selection import Selection
from .base import Aggregate, Budget, KVSelector, KVState, check_count
from .choose import check_rescore, choose_pages
from .scoring import (
    aggregate_groups,
    PageBound,
    bound_summaries,
    check_page_bound,
    forced_pages,
    group_page_bounds,
    page_bound_scores,
    page_budget,
    page_k_max,
)
from .registry import register


def page_gaussians(state: KVState, q: Tensor) -> tuple[Tensor, Tensor]:
    """Per query head and page, the Gaussian model of ``scale·q·k``: ``(μ, σ) float32[B, H, P]``
    (`kernels.page_gaussians` over the layer's page mean and standard deviation)."""
    cache = state.cache
    return kernels.page_gaussians(q, cache.page_mean[state.layer], cache.page_std[state.layer], state.scale)


@register("entmax-kv")
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
        z: standard deviations (>= 0) above the mean of a page's Gaussian score model: the upper
            quantile that must clear the threshold.
        iters: the most Newton steps of the threshold estimate (`gaussian_entmax_threshold`, which
            stops once τ settles).
        float64_steps: how many of those steps may be float64, after the float32 ones. 0 (the
            default): all float32, τ̂ within about 1e-5 of the pool's scale (its largest
            ``|μ/2| + σ/2``) of the float64 root, far below what the Gaussian page model itself is off
            by; 3 gives the root to ~1e-11, with float64 passes over the pages on a GPU.
        rescore: 0, or a candidate factor >= 1: that many times the chosen pages are candidates and
            the best tokens by exact score are kept (`kv.choose.rescore_pages`; as `Quest`'s).
        aggregate: how the second stage folds a GQA group's exact logits: ``"max"`` (the group's
            best logit) or ``"sum"`` (its summed softmax mass). Pages are always ranked by the
            group's max.
        bound: the page bound: ``"box"`` (the page min/max) or ``"sketch"`` (the 4-bit key sketch,
            about a nat over a page's best key instead of many; `kv.scoring.page_bound_scores`).
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
    float64_steps: int = 0
    rescore: float = 0.0
    aggregate: Aggregate = "max"
    bound: PageBound = "box"
    layer_invariant = True

    def __post_init__(self) -> None:
        self._budget = Budget(self.budget)
        check_page_bound(self.bound)
        if self.aggregate not in ("sum", "max"):
            raise ValueError(f"aggregate must be 'sum' or 'max', got {self.aggregate!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha != 1.5:
            raise ValueError(f"alpha must be 1.5 (the only α the entmax kernel implements), got {self.alpha!r}")
        if self.mode not in ("gaussian", "topk"):
            raise ValueError(f"mode must be 'gaussian' or 'topk', got {self.mode!r}")
        if self.attention not in ("softmax", "entmax"):
            raise ValueError(f"attention must be 'softmax' or 'entmax', got {self.attention!r}")
        check_count(self.page, "page", minimum=1)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        if isinstance(self.z, bool) or not isinstance(self.z, (int, float)) or not (math.isfinite(self.z) and self.z >= 0):
            raise ValueError(f"z must be a finite number >= 0 (standard deviations above a page's mean score), got {self.z!r}")
        check_count(self.iters, "iters", minimum=1)
        check_count(self.float64_steps, "float64_steps")
        check_rescore(self.rescore)

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.page

    @property
    def two_stage(self) -> bool:  # type: ignore[override]
        return bool(self.rescore)

    @property
    def summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        moments = ("page_mean", "page_std") if self.mode == "gaussian" else ()
        return bound_summaries(self.bound) + moments

    def page_scores(self, state: KVState, q: Tensor) -> Tensor:
        """``float32[B, H_kv, P]`` ranking scores (``-inf`` on pages without visible tokens).

        ``"topk"``: the group max of the Quest bound. ``"gaussian"``: the group max of the margin
        ``min(μ_p/2 + z·σ_p/2, u_p/2) − τ̂_h``; a page is a candidate iff its margin is positive.
        """
        if self.mode == "topk":
            return group_page_bounds(state, q, self.bound)
        valid = state.page_valid()
        h_kv = state.keys.shape[1]
        bound = page_bound_scores(state, q, self.bound)  # [B, H, P]
        bound = torch.where(valid[:, None, :], bound, 0.0)  # a finite cap on empty pages (the sketch gives -inf)
        mu, sigma = page_gaussians(state, q)
        counts = state.cache.page_counts()[:, None, :].expand_as(mu)
        m = torch.where(valid[:, None, :], mu * 0.5, -torch.inf)
        tau = kernels.gaussian_entmax_threshold(m, sigma * 0.5, counts, 0.5 * bound, self.iters, self.float64_steps,
                                                workspace=state.workspace).float()
        upper = torch.minimum(0.5 * (mu + self.z * sigma), 0.5 * bound)
        margin = torch.where(torch.isfinite(tau), upper - tau, torch.inf)
        return aggregate_groups(margin, valid, h_kv, "max")

    def select(self, state: KVState, q: Tensor) -> Selection:
        if self.mode == "topk":  # Quest's choice (the box's bound scored inside the choice's launch)
            k_max = page_k_max(state, self._budget, self.page, self.sinks, self.window, "EntmaxKV")
            scores = None if self.bound == "box" else self.page_scores(state, q)
            return choose_pages(state, q, scores, None, k_max, self._budget, rescore=self.rescore, sinks=self.sinks,
                                window=self.window, aggregate=self.aggregate)
        k_max, count = page_budget(state, self._budget, self.page, self.sinks, self.window, "EntmaxKV")
        valid = state.page_valid()
        scores = self.page_scores(state, q)
        forced = forced_pages(state, self.sinks, self.window)
        # Keep forced ∪ candidates (positive margins), the best of them under the cap.
        f = forced[:, None, :] & valid[:, None, :]
        count = torch.minimum(count[:, None], (f | (scores > 0)).sum(-1))  # per KV head
        return choose_pages(state, q, scores, forced, k_max, count, rescore=self.rescore, sinks=self.sinks,
                            window=self.window, aggregate=self.aggregate)
