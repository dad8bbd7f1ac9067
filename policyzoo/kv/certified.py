"""Certified dropped mass: an upper bound of the softmax mass a selection drops, from page summaries.

With logits ``z_t = scale·q·k_t``, a selection ``S`` and the Quest page bound ``u_p ≥ z_t`` for every
token ``t`` of page ``p``, the dropped mass of dense softmax is

    δ = Z_out / (Z_S + Z_out),   Z_S = Σ_{t∈S} e^{z_t},   Z_out = Σ_{t∉S} e^{z_t} ≤ U = Σ_p (n_p − k_p)·e^{u_p}

(``n_p`` visible tokens of page ``p``, ``k_p`` of them selected), and ``x ↦ x / (Z_S + x)`` is
increasing, so ``δ ≤ U / (Z_S + U)``. ``log Z_S`` is the ``lse`` the attention kernel already returns
for the selection, and ``u_p``, ``n_p``, ``k_p`` come from the cache summaries and the selection's
indices: the bound costs no KV read. It is computed in log space (``sigmoid(log U − lse)``; the
``exp(u_p − m)`` shift of the formula is the logsumexp's), per query head.

The page bound overshoots a page's best key by many nats on real models (13 on SmolLM2, pages of 16),
and the certificate multiplies each unselected token's mass by that factor: with the box alone it
reads about 1 whatever the selection. Where the cache keeps the 4-bit key sketch (a policy with
``bound="sketch"``), every unselected token gets its own bound from its sketch instead,
``U = Σ_{t∉S} e^{û_t}`` with ``û_t`` about a nat over ``z_t``, and the certificate follows δ.

The bound needs the *unweighted* normaliser of ``S``: a selection with ``log_weight`` (SSA's
Horvitz–Thompson weights) gets an lse that estimates the dense one, not ``Z_S``, and is rejected.
It is a softmax statement; entmax attention has exact zeros and its own support test (`EntmaxKV`).

`grow_until_certified` turns the bound into a guard: over a priority-ordered candidate list of static
width, it picks the shortest prefix whose bound is at most ``eps`` (every query head of the group).
Choosing the prefix needs ``Z`` of every prefix, so the guard reads the *keys* (not the values) of the
candidates once — the one KV read it adds. `Certified` wraps a policy with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, is_dataclass, replace

import torch
from torch import Tensor

from ..selection import Selection
from ..cache import SKETCH
from .base import KVSelector, KVState, check_budget
from .choose import selection_logits
from .scoring import page_bound_scores, token_bound_scores
from .wrapper import PolicyWrapper
from .registry import register

DEFAULT_SLACK = 1e-5


def _widen(u: Tensor, slack: float) -> Tensor:
    """``float64`` bounds widened by ``slack·(1 + |u|)`` (float rounding of the kernels); ``-inf`` stays."""
    u = u.double()
    return torch.where(u > -torch.inf, u + slack * (1.0 + u.abs()), u)


def _has_sketch(state: KVState) -> bool:
    return state.cache.keeps(SKETCH)


def _page_bounds(state: KVState, q: Tensor, slack: float) -> Tensor:
    """``float64[B, H, P]`` widened page bounds: the sketch's where the cache keeps it, else the box."""
    return _widen(page_bound_scores(state, q, "sketch" if _has_sketch(state) else "box"), slack)


def _token_bounds(state: KVState, q: Tensor, slack: float) -> Tensor:
    """``float64[B, H, N]`` widened per-token bounds from the key sketch (``-inf`` where not visible)."""
    return _widen(token_bound_scores(state, q), slack)


def _kept_per_page(state: KVState, sel: Selection) -> Tensor:
    """``int64[B, H_kv, P]``: visible tokens of each page that ``sel`` selects (index ops only)."""
    cache = state.cache
    mask = sel.token_mask(cache.capacity) & state.token_valid()[:, None, :]
    return mask.view(*mask.shape[:2], cache.num_pages, cache.page_size).sum(-1)


def priority_order(state: KVState, q: Tensor, wide: Selection, base: Selection, bounds: Tensor) -> Selection:
    """``wide`` reordered for growing: ``base``'s entries first, then the others by page bound.

    Policies return their entries in position order (`choose_topk`), but a certified prefix must
    start with what the policy itself keeps (sinks, window, its budget) and then add the entries
    most likely to carry mass. Any order gives valid bounds; this one certifies soonest. ``base``
    must be a subset of ``wide`` (the same policy at a smaller budget is). ``bounds`` are the
    widened page bounds ``float64[B, H, P]`` (`_page_bounds`, computed once per step by the caller).
    """
    cache = state.cache
    b, h, _ = q.shape
    h_kv = state.keys.shape[1]
    idx = wide.indices.long()
    first_token = (idx * wide.block).clamp(max=cache.capacity - 1)
    in_base = torch.gather(base.token_mask(cache.capacity), 2, first_token)
    u = bounds.view(b, h_kv, h // h_kv, -1).amax(2)  # [B, H_kv, P]
    page_of = torch.div(first_token, cache.page_size, rounding_mode="floor")
    priority = torch.gather(u, 2, page_of)
    priority = torch.where(in_base, torch.inf, priority)
    priority = torch.where(wide.entry_valid(), priority, -torch.inf)
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    return Selection(torch.gather(wide.indices, 2, order), wide.count, block=wide.block)


def _log_dropped_bound(state: KVState, q: Tensor, sel: Selection, slack: float) -> Tensor:
    """``float64[B, H]``: ``log U`` over the pages' unselected visible tokens."""
    b, h, _ = q.shape
    h_kv = state.keys.shape[1]
    if _has_sketch(state):
        out = ~sel.token_mask(state.cache.capacity).repeat_interleave(h // h_kv, dim=1)  # [B, H, N]
        return torch.logsumexp(_token_bounds(state, q, slack).masked_fill(~out, -torch.inf), dim=-1)
    u = _page_bounds(state, q, slack).view(b, h_kv, h // h_kv, -1)
    rest = state.cache.page_counts()[:, None, :] - _kept_per_page(state, sel)  # [B, H_kv, P]
    log_rest = torch.log(rest.clamp(min=0).double())[:, :, None, :]  # log 0 = -inf: nothing dropped
    return torch.logsumexp(u + log_rest, dim=-1).reshape(b, h)


def certified_dropped_mass(
    state: KVState, q: Tensor, sel: Selection, lse: Tensor, slack: float = DEFAULT_SLACK
) -> Tensor:
    """``float32[B, H]`` upper bound ``U / (Z_S + U)`` of the softmax mass ``sel`` drops.

    Args:
        state: the layer's state (cache summaries and visibility).
        q: ``[B, H, D]`` the step's queries.
        sel: any token or page selection without ``log_weight``.
        lse: ``float32[B, H]`` ``log Z_S``, as returned by `kernels.decode_attention` for ``sel``.
        slack: relative widening of the page bounds against float rounding (``0`` for the bare formula).
    """
    if sel.log_weight is not None:
        raise ValueError("the certified bound needs the selection's unweighted normaliser: sel has log_weight")
    log_u = _log_dropped_bound(state, q, sel, slack)
    bound = torch.sigmoid(log_u - lse.double())  # lse = -inf (nothing kept) gives 1, log U = -inf gives 0
    return bound.nan_to_num(0.0).float()


def certify_before_attention(state: KVState, q: Tensor, sel: Selection, slack: float = DEFAULT_SLACK) -> Tensor:
    """``float32[B, H]``: `certified_dropped_mass` of ``sel`` for ``q`` before attending through it.

    The bound needs ``log Z_S``, which the attention kernel returns only after the fact; a policy
    that must decide first (`PrHS`, before reusing a selection) gets it here from the exact logits
    of the selection's keys (`kernels.gathered_logits`: the keys are read, not the values).
    """
    if sel.log_weight is not None:
        raise ValueError("the certified bound needs the selection's unweighted normaliser: sel has log_weight")
    b, h, _ = q.shape
    logits, _, _ = selection_logits(state, q, sel)  # [B, H_kv, G, N], -inf where not visible
    lse = logits.logsumexp(-1).reshape(b, h)
    return certified_dropped_mass(state, q, sel, lse, slack)


def grow_until_certified(
    state: KVState,
    q: Tensor,
    ranked: Selection,
    eps: float,
    min_count: Tensor | None = None,
    slack: float = DEFAULT_SLACK,
    bounds: Tensor | None = None,
) -> tuple[Selection, Tensor]:
    """The shortest prefix of ``ranked`` whose certified bound is at most ``eps``.

    Args:
        ranked: candidates in priority order (``count`` = the most that may be kept; static width
            ``K_max``), unique and visible, without ``log_weight``.
        eps: target bound on the dropped mass, for every query head of each KV head's group.
        min_count: ``int[B, H_kv]`` (or ``[B]``) shortest prefix allowed (default 0).
        bounds: the widened page bounds (`_page_bounds` with ``slack``) when the caller has them (a cache
            with the key sketch bounds each token instead).

    Returns:
        ``(selection, bound)``: ``ranked`` with ``count`` cut to the chosen prefix (the whole list
        when no prefix certifies), and ``bound float32[B, H]`` at that prefix. No host sync.

    Cost: ``Z`` of every prefix comes from one pass over the keys of the ``K_max`` candidates (the
    values are not read); the page bounds and counts are summaries.
    """
    if ranked.log_weight is not None:
        raise ValueError("grow_until_certified needs a selection without log_weight")
    if not 0.0 <= float(eps) <= 1.0:
        raise ValueError(f"eps must be in [0, 1], got {eps}")
    cache = state.cache
    b, h, d = q.shape
    keys = state.keys
    h_kv, n = keys.shape[1], keys.shape[2]
    g = h // h_kv
    k_max, blk = ranked.k_max, ranked.block
    entry_ok = ranked.entry_valid()  # [B, H_kv, K]

    # log Z of each entry (reads the candidates' keys once), then of each prefix.
    pos, _ = ranked.token_positions()  # [B, H_kv, K*blk]
    tok_valid = state.token_valid()
    in_seq = torch.gather(tok_valid[:, None, :].expand(-1, h_kv, -1), 2, pos.clamp(0, n - 1))
    ok = entry_ok.repeat_interleave(blk, dim=-1) & in_seq & (pos < n)
    k_sel = torch.gather(keys, 2, pos.clamp(0, n - 1).unsqueeze(-1).expand(-1, -1, -1, d)).float()
    logits = torch.einsum("bkgd,bkmd->bkgm", q.float().view(b, h_kv, g, d), k_sel) * state.scale
    logits = logits.masked_fill(~ok[:, :, None, :], -torch.inf).double()
    entry_lse = torch.logsumexp(logits.view(b, h_kv, g, k_max, blk), dim=-1)  # [B, H_kv, G, K]
    neg = torch.full((b, h_kv, g, 1), -torch.inf, dtype=torch.float64, device=q.device)
    prefix_lse = torch.cat([neg, torch.logcumsumexp(entry_lse, dim=-1)], -1)  # [.., K+1]: k entries

    # log U of each prefix: the candidates after it plus everything outside the candidate list.
    if blk not in (1, cache.page_size):
        raise ValueError(f"selection block {blk} must be 1 or the cache page size {cache.page_size}")
    outside = Selection(ranked.indices, ranked.count, block=blk)
    if _has_sketch(state):  # each token's own bound: an entry's is the logsumexp of its tokens'
        tb = _token_bounds(state, q, slack).view(b, h_kv, g, n)
        at = torch.gather(tb, 3, pos.clamp(0, n - 1)[:, :, None, :].expand(-1, -1, g, -1))
        at = at.masked_fill(~ok[:, :, None, :], -torch.inf).view(b, h_kv, g, k_max, blk)
        entry_w = torch.logsumexp(at, dim=-1)  # [B, H_kv, G, K]
        rest_mask = ~outside.token_mask(n)[:, :, None, :]
        log_out = torch.logsumexp(tb.masked_fill(~rest_mask, -torch.inf), dim=-1, keepdim=True)
    else:  # each entry's tokens and the rest at their page's bound
        u = (_page_bounds(state, q, slack) if bounds is None else bounds).view(b, h_kv, g, -1)  # [B, H_kv, G, P]
        page_of = torch.div(ranked.indices.long() * blk, cache.page_size, rounding_mode="floor")
        page_of = page_of.clamp(0, cache.num_pages - 1)
        counts = cache.page_counts()  # [B, P]
        tokens = torch.gather(counts[:, None, :].expand(-1, h_kv, -1), 2, page_of) if blk == cache.page_size else ok.long()
        tokens = torch.where(entry_ok, tokens, 0)
        entry_u = torch.gather(u, 3, page_of[:, :, None, :].expand(-1, -1, g, -1))
        entry_w = entry_u + torch.log(tokens.double())[:, :, None, :]  # [B, H_kv, G, K]
        rest = counts[:, None, :] - _kept_per_page(state, outside)
        log_out = torch.logsumexp(u + torch.log(rest.clamp(min=0).double())[:, :, None, :], dim=-1, keepdim=True)
    suffix = torch.logcumsumexp(entry_w.flip(-1), dim=-1).flip(-1)
    suffix = torch.cat([suffix, neg], -1)  # [.., K+1]: mass of the entries from k on
    log_u = torch.logaddexp(suffix, log_out.expand_as(suffix))

    bound = torch.sigmoid(log_u - prefix_lse).nan_to_num(0.0)  # [B, H_kv, G, K+1]
    worst = bound.amax(2)  # [B, H_kv, K+1]
    ks = torch.arange(k_max + 1, device=q.device)
    lo = torch.zeros_like(ranked.count) if min_count is None else min_count
    lo = (lo[:, None] if lo.dim() == 1 else lo).long()
    hi = ranked.count.long()
    fine = (worst <= eps) & (ks >= lo[..., None]) & (ks <= hi[..., None])
    first = torch.where(fine, ks, k_max + 1).amin(-1)
    chosen = torch.where(first <= k_max, first, hi)  # [B, H_kv]
    at = torch.gather(bound, 3, chosen[:, :, None, None].expand(-1, -1, g, 1)).reshape(b, h)
    return Selection(ranked.indices, chosen.int(), block=blk), at.float()


@dataclass
class CertifiedLayer:
    """`Certified`'s state of one layer: the certified dropped-mass bound of its last step,
    ``float32[B, H]`` (None before the prefill)."""

    bound: Tensor | None = None


@register("certified")
@dataclass
class Certified(PolicyWrapper):
    """Grow a policy's selection until the certified dropped-mass bound is under ``eps``.

    ``policy`` must be a softmax policy whose selections have no ``log_weight``, with a ``budget``
    field (`Quest`, `AttentionTopK`, `EntmaxKV`, `SSA` with ``sample=0``, `CommunityKV`): its own budget
    is the minimum, the same policy at ``max_budget`` gives the candidates (static width; reordered by
    `priority_order`), and the kept count is the shortest prefix that certifies (or all candidates).
    ``max_budget`` caps the selection: it may not be below the policy's budget (when both are keep
    ratios or both token counts; a token cap over a ratio budget, or the reverse, caps the policy's
    own budget where it is the smaller). The bound of each step is left in
    the layer's `CertifiedLayer` (``state.layer_state_of(certified).bound``, ``float32[B, H]``, allocated at prefill and written in place;
    no host sync). Cost per step: the policy's scoring twice (its own budget and the wide copy) plus
    one pass over the keys of the wide candidates (`grow_until_certified`).
    """

    policy: KVSelector
    eps: float = 0.05
    max_budget: int | float = 0.5
    slack: float = DEFAULT_SLACK
    own_summaries = ("page_min", "page_max")  # the bound reads the page min/max
    own_prefill = True  # the per-step bound's tensor is made in prefill

    def __post_init__(self) -> None:
        self.check_policy()
        if not (is_dataclass(self.policy) and hasattr(self.policy, "budget")):
            raise TypeError(f"Certified: policy must be a KV policy with a budget (Quest, AttentionTopK, EntmaxKV, ...), "
                            f"got {type(self.policy).__name__}")  # fmt: skip
        if self.policy.weighted:  # SSA's sampled entries carry weights the bound cannot take
            self.refuse(f"its sampled entries carry weights the certificate cannot take (sample={getattr(self.policy, 'sample', '?')!r}); "
                        "use sample=0 (its top-k stratum) or another policy")  # fmt: skip
        if self.policy.attention != "softmax":
            self.refuse("the certificate bounds softmax dropped mass; an entmax policy has exact zeros and its own support test")
        if self.policy.selects_ahead:
            self.refuse("Certified runs its policy twice per layer (at its budget and at max_budget), and this policy makes "
                        "each layer's selection one layer ahead, which must run once per layer")  # fmt: skip
        check_budget(self.max_budget, "max_budget")
        budget = self.policy.budget
        if isinstance(budget, float) == isinstance(self.max_budget, float) and self.max_budget < budget:
            raise ValueError(f"max_budget={self.max_budget!r} is below the policy's own budget={budget!r}: the certified "
                             "selection grows from the policy's budget up to max_budget")  # fmt: skip
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0.0 <= self.eps <= 1.0:
            raise ValueError(f"eps must be a number in [0, 1], got {self.eps!r}")
        if isinstance(self.slack, bool) or not (isinstance(self.slack, (int, float)) and math.isfinite(self.slack) and self.slack >= 0):
            raise ValueError(f"slack must be a finite number >= 0, got {self.slack!r}")
        try:
            self._wide = replace(self.policy, budget=self.max_budget)
        except ValueError as e:  # the policy at max_budget is invalid (e.g. smaller than sinks + window)
            raise ValueError(f"max_budget={self.max_budget!r}: {e}") from None
        self._share_modules()

    def _share_modules(self) -> None:
        """The wide copy scores with the policy's own learned parts (not copies of them)."""
        for name, module in self.policy.modules().items():
            setattr(self._wide, name, module)

    def attach(self, model) -> None:
        self.policy.attach(model)
        self._share_modules()

    def new_layer_state(self) -> CertifiedLayer:
        return CertifiedLayer()

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        self.policy.prefill(state, q, k, v)
        state.share_layer_state(self._wide, self.policy)  # the wide copy scores from the same prefill
        # Allocated here (eager) and written in place by `select`, so a compiled decode step sees
        # the same tensor every step (no recompilation) and a CUDA graph may update it.
        bound = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
        if bound.device.type == "cuda":
            torch._dynamo.mark_static_address(bound)
        state.layer_state_of(self).bound = bound

    def select(self, state: KVState, q: Tensor) -> Selection:
        base = self.policy.select(state, q)
        wide = self._wide.select(state, q)
        if wide.log_weight is not None or base.log_weight is not None:
            raise ValueError("Certified needs a policy whose selections have no log_weight")
        bounds = _page_bounds(state, q, self.slack)  # once per step: ordering and certifying share it
        wide = priority_order(state, q, wide, base, bounds)
        sel, bound = grow_until_certified(state, q, wide, self.eps, min_count=base.count, slack=self.slack, bounds=bounds)
        layer = state.layer_state_of(self)
        if layer.bound is not None and layer.bound.shape == bound.shape:
            layer.bound.copy_(bound)
        else:
            layer.bound = bound
        return sel
