"""`SSA`: stratified sparse attention — a deterministic top stratum plus a sampled, Horvitz–Thompson
corrected residual stratum.

Each step, per (batch row, KV head):

1. **Proxy scores** ``s_j`` for every entry: the Quest page upper bound from the cache summaries
   (``proxy="page"``, entries are pages; no key is read) or the exact ``scale·q·k`` (``proxy="exact"``,
   entries are tokens; reads every key, for audits). The query heads of a GQA group are folded by
   the shared `aggregate_groups` (``"max"`` logit or ``"sum"`` of softmax mass) for the ranking.
2. **Deterministic stratum** ``D``: the forced entries (sinks, window; the last page for pages) plus
   the top ``budget`` entries by proxy — exactly the `Quest` / `AttentionTopK` choice (`choose_topk`).
3. **Sampled stratum**: ``m`` draws from the residual ``R = valid \\ D`` with probabilities
   ``p_j = (1/G)·Σ_h softmax_R(s_{h,·} / temperature)_j``: the mean over the ``G`` query heads of
   the group of each head's tempered proxy softmax over ``R`` (whatever ``aggregate`` ranks by).
   The mixture keeps every head's importance weights bounded (``p_j ≥ softmax_R(s_h/T)_j / G``);
   a softmax of the group's max logit would starve a head whose mass sits where another head's
   logits are low, which makes that head's estimates heavy-tailed.
4. **Correction**: every sampled (unique) entry ``j`` gets ``log_weight = −log π_j``, deterministic
   entries ``0``, so the kernel computes ``Σ_{i∈S} w_i e^{z_i} v_i / Σ_{i∈S} w_i e^{z_i}`` with both
   sums Horvitz–Thompson estimates of the dense numerator and denominator
   (``E[1{j∈S}/π_j] = 1``); ``lse`` is the log of the denominator estimate.

Schemes (``scheme``):

- ``"with_replacement"`` (default): ``m`` i.i.d. draws by inverse CDF (``searchsorted`` on the
  float64 cumulative ``p``); duplicates are merged, so each unique entry appears once, with its exact
  marginal inclusion probability ``π_j = 1 − (1 − p_j)^m``.
- ``"gumbel_topk"``: ``m`` distinct entries, the top ``m`` of ``log p_j + G_j`` (``G_j`` i.i.d.
  Gumbel), i.e. successive sampling without replacement. Its marginal inclusion probabilities are a
  sum over orderings (intractable for large ``m``), so the weight is the *conditional* inclusion
  probability given the threshold ``κ`` = the ``(m+1)``-th largest perturbed key:
  ``π_j(κ) = P(log p_j + G > κ) = 1 − exp(−exp(log p_j − κ))`` (``κ = −∞``, ``π = 1``, when ``R``
  holds at most ``m`` entries). Conditioning on the other entries' keys shows
  ``E[1{j∈S}/π_j(κ)] = 1`` (priority sampling, Duffield et al. 2007; Kool et al. 2019), so this
  Horvitz–Thompson-type estimate is unbiased too. These ``π_j(κ)`` are not marginal frequencies.
  Its variance is finite only for ``m ≥ 2`` (``E[1/π_j(κ)]`` diverges for one draw), so a row
  with a single draw uses the exact marginal ``π_j = p_j`` instead; for small ``m`` the tails
  are heavier than with replacement, which is why with replacement is the default.

Shapes are static: ``K_max = deterministic width (budget + forced) + m``; ``count`` says how many
entries are real (deterministic first, then the unique sampled ones). Randomness is reproducible
from ``seed``: by default a counter-based hash generator (`hash_uniform`: the uniforms of a step
hash ``(seed, draw counter, element)``; the counter, a small int64 tensor per device, advances in
place each `select`), which traces into torch.compile graphs and CUDA graphs without a graph break;
or an explicit ``generator`` (a `torch.Generator`, eager only: torch.compile breaks the graph at a
``generator=`` argument). `reseed` restarts the stream. Nothing syncs with the host. The hash names
an element by its KV head and its place in the row (the entry's offset from the row's first visible
entry, or the draw's number), never by the batch row or the cache slot, so a row draws the same
uniforms in any batch as alone; an explicit ``generator`` draws in order and does not.

Special cases: ``sample=0`` is exactly the top-k policy on the same proxy (`Quest` for ``"page"``,
`AttentionTopK` for ``"exact"``, with the same ``aggregate``), returned without ``log_weight``;
``budget=0`` is pure sampling (only the forced entries are deterministic).

Budgets: ``budget`` and ``sample`` are tokens (an ``int``; ``ceil(n / page)`` entries for the page
proxy) or keep ratios of the visible entries (a ``float`` in (0, 1]); ``sample`` counts *draws*
(with replacement, fewer unique entries may result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..selection import Selection
from .base import Aggregate, Budget, KVSelector, KVState, check_budget, check_count
from .choose import candidate_budget, check_rescore, box_pages, choose_topk, page_log_mass
from .scoring import (
    PageBound,
    aggregate_groups,
    bound_summaries,
    check_page_bound,
    exact_scores,
    forced_pages,
    forced_tokens,
    group_page_bounds,
    page_bound_scores,
)
from .registry import register

Scheme = Literal["with_replacement", "gumbel_topk"]


def _check_zero_or_budget(value: object, name: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return
    check_budget(value, name)


@register("ssa")
@dataclass
class SSA(KVSelector):
    """Stratified sparse attention: top ``budget`` entries by proxy plus ``sample`` corrected draws.

    Args:
        budget: deterministic stratum, tokens (int >= 0) or keep ratio (float in (0, 1]).
        sample: draws of the sampled stratum, tokens (int >= 0) or ratio of the visible entries.
        proxy: ``"page"`` (Quest bound, page selections) or ``"exact"`` (exact scores, tokens).
        temperature: the sampling distribution is ``softmax(proxy / temperature)`` over the residual.
        page: cache page size needed by the page proxy.
        sinks, window: tokens always kept (the pages holding them for the page proxy; the last page
            is always kept there).
        aggregate: GQA folding of the group's proxy scores, ``"max"`` or ``"sum"``.
        scheme: ``"with_replacement"`` (marginal π) or ``"gumbel_topk"`` (conditional π, see module).
        seed: seed of the counter-based hash generator (an int >= 0).
        generator: a `torch.Generator` to draw from instead (eager decoding only).
        rescore: page proxy only: 0, or a candidate factor >= 1: that many times the pages of both
            strata are candidates by bound, and the proxy becomes each page's log softmax numerator,
            exact for the candidates (from their keys) and estimated for the rest from their bound
            and the bound's overshoot on the candidates (`kv.choose.page_log_mass`); both strata rank
            and sample on it.
        bound: page proxy only: the page bound, ``"box"`` (the page min/max) or ``"sketch"`` (the
            4-bit key sketch, about a nat over a page's best key; `kv.scoring.page_bound_scores`).
    """

    budget: int | float = 0.1
    sample: int | float = 0.05
    proxy: Literal["page", "exact"] = "page"
    temperature: float = 1.0
    page: int = 16
    sinks: int = 4
    window: int = 16
    aggregate: Aggregate = "max"
    scheme: Scheme = "with_replacement"
    seed: int = 0
    generator: torch.Generator | None = field(default=None, repr=False, compare=False)
    rescore: float = 0.0
    bound: PageBound = "box"
    _rng: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_zero_or_budget(self.budget, "budget")
        _check_zero_or_budget(self.sample, "sample")
        if self.proxy not in ("page", "exact"):
            raise ValueError(f"proxy must be 'page' or 'exact', got {self.proxy!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(self.temperature).__name__}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature}")
        check_count(self.page, "page", minimum=1)
        check_count(self.sinks, "sinks")
        check_count(self.window, "window")
        if self.aggregate not in ("sum", "max"):
            raise ValueError(f"aggregate must be 'sum' or 'max', got {self.aggregate!r}")
        if self.scheme not in ("with_replacement", "gumbel_topk"):
            raise ValueError(f"scheme must be 'with_replacement' or 'gumbel_topk', got {self.scheme!r}")
        check_count(self.seed, "seed", maximum=None)  # a seed, not a token count: any size
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")
        check_rescore(self.rescore)
        if self.rescore and self.proxy != "page":
            raise ValueError("rescore applies to the page proxy: proxy='exact' scores every key exactly already")
        check_page_bound(self.bound)
        if self.bound != "box" and self.proxy != "page":
            raise ValueError("bound applies to the page proxy: proxy='exact' scores every key exactly already")

    @property
    def page_size(self) -> int | None:  # type: ignore[override]
        return self.page if self.proxy == "page" else None

    @property
    def summaries(self) -> tuple[str, ...]:  # type: ignore[override]
        return bound_summaries(self.bound) if self.proxy == "page" else ()

    layer_invariant = True
    own_prefill = True  # the random stream's state is made in prefill

    @property
    def weighted(self) -> bool:  # type: ignore[override]
        return self.sample != 0

    @property
    def two_stage(self) -> bool:  # type: ignore[override]
        return bool(self.rescore)

    def reset_random(self) -> None:
        self.reseed(self.seed)

    # ------------------------------------------------------------------------------- randomness
    def reseed(self, seed: int) -> None:
        """Restart the random stream from ``seed`` (in place: a compiled step keeps its buffers)."""
        check_count(seed, "seed", maximum=None)
        self.seed = seed
        for state in self._rng.values():
            state.copy_(torch.tensor([seed & _MASK32, (seed >> 32) & _MASK32, 0]))

    def rng_state(self, device: torch.device) -> Tensor:
        """``int64[3]`` (seed low, seed high, draw counter) of the hash generator on ``device``.

        Created on first use (the Decoder's eager prefill reaches `prefill` first, so a compiled
        step finds it); marked as a static address on CUDA so that CUDA graphs may advance it.
        """
        key = str(device)
        state = self._rng.get(key)
        if state is None:
            state = torch.tensor([self.seed & _MASK32, (self.seed >> 32) & _MASK32, 0], device=device)
            if state.device.type == "cuda" and not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(state)
            self._rng[key] = state
        return state

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        self.rng_state(q.device)

    def uniform(self, elements: Tensor) -> Tensor:
        """``float64`` uniforms in (0, 1), one per id in ``elements`` (an int64 tensor): from
        `generator` if one was given (eager only: a ``generator=`` argument breaks the graph under
        torch.compile; it ignores the ids), else from the counter-based hash generator, whose counter
        advances in place (no host sync, no graph break)."""
        if self.generator is not None:
            u = torch.rand(elements.shape, generator=self.generator, device=elements.device, dtype=torch.float64)
            return u.clamp(min=2.0**-54)
        state = self.rng_state(elements.device)
        u = hash_uniform(state, elements)
        state[2].add_(1)
        return u

    # ------------------------------------------------------------------------------------ units
    @staticmethod
    def _widths(value: int | float, unit: int, n_units: int, n_valid: Tensor) -> tuple[int, Tensor]:
        """Static width and per-row count (``int64[B]``) of ``value`` tokens / ratio in entries."""
        if isinstance(value, int) and value == 0:
            return 0, torch.zeros_like(n_valid)
        b = Budget(value)
        if b.is_ratio:
            return b.k_max(n_units), b.count(n_valid)
        wanted = math.ceil(value / unit)
        return min(n_units, wanted), torch.full_like(n_valid, wanted)

    # ----------------------------------------------------------------------------------- select
    def select(self, state: KVState, q: Tensor) -> Selection:
        cache = state.cache
        h_kv = state.keys.shape[1]
        if self.proxy == "page":
            if state.page_size != self.page:
                raise ValueError(f"SSA(page={self.page}) needs a cache with page_size={self.page}, got {state.page_size}")
            valid = state.page_valid()
            raw = page_bound_scores(state, q, self.bound)
            forced = forced_pages(state, self.sinks, self.window)
            unit, n_units = self.page, cache.num_pages
            # Sinks and window may each straddle one more page than their length needs (as Quest).
            n_forced = math.ceil(self.sinks / self.page) + math.ceil(max(self.window, 1) / self.page) + 2
        else:
            valid = state.token_valid()
            raw = exact_scores(state, q)
            forced = forced_tokens(state, self.sinks, self.window)
            unit, n_units = 1, cache.capacity
            n_forced = self.sinks + self.window
        n_valid = valid.sum(-1)
        ranking = aggregate_groups(raw, valid, h_kv, self.aggregate)
        k_det, count_det = self._widths(self.budget, unit, n_units, n_valid)
        k_det = max(k_det, min(n_units, n_forced))
        if self.rescore:  # both strata on the pages' log-mass: exact for the candidates
            m_max, m_count = self._widths(self.sample, unit, n_units, n_valid)
            wide, wide_count = candidate_budget(k_det + m_max, count_det + m_count, self.rescore, n_units)
            if self.bound == "box":  # the bound and the choice in one launch
                candidates = box_pages(state, q, wide, wide_count, self.sinks, self.window)
            else:
                candidates = choose_topk(group_page_bounds(state, q, self.bound), forced, wide, wide_count, block=unit,
                                         workspace=state.workspace)
            raw = page_log_mass(state, q, raw, candidates)
            ranking = aggregate_groups(raw, valid, h_kv, self.aggregate)
        det = choose_topk(ranking, forced, k_det, count_det, block=unit, workspace=state.workspace)
        if self.sample == 0:
            return det

        m, m_row = self._widths(self.sample, unit, n_units, n_valid)
        m_row = m_row.clamp(max=m)[:, None]  # [B, 1] draws per row
        # Residual: valid entries outside the deterministic stratum.
        in_det = _entry_mask(det, n_units)
        residual = valid[:, None, :] & ~in_det  # [B, H_kv, N]
        log_p = self._log_probs(raw, residual, h_kv)  # float64 [B, H_kv, N]
        b = log_p.shape[0]
        # Element ids by KV head and place in the row, not by batch row or slot (batch invariance).
        heads = torch.arange(h_kv, device=q.device)[None, :, None] * _HEAD_STREAM
        if self.scheme == "with_replacement":
            draws = torch.arange(m, device=q.device)[None, None, :]
            u = self.uniform((heads + draws).expand(b, h_kv, m))
            samp_idx, samp_ok, log_pi = _draw_with_replacement(log_p, residual, m, m_row, u)
        else:
            first = torch.div(cache.start, unit, rounding_mode="floor")[:, None, None]  # the row's first entry
            offsets = torch.arange(n_units, device=q.device)[None, None, :] - first
            u = self.uniform(heads + offsets)
            samp_idx, samp_ok, log_pi = _draw_gumbel_topk(log_p, residual, m, m_row, u)
        return _merge(det, samp_idx, samp_ok, log_pi, unit)

    def _log_probs(self, raw: Tensor, residual: Tensor, h_kv: int) -> Tensor:
        """``float64[B, H_kv, N]``: log of the sampling distribution over the residual (``-inf`` off
        it): the mean over the group's heads of each head's ``softmax(proxy / temperature)``."""
        b, h, n = raw.shape
        per_head = raw.double().view(b, h_kv, h // h_kv, n) / float(self.temperature)
        per_head = torch.where(residual[:, :, None, :], per_head, -torch.inf)
        log_p = torch.logsumexp(torch.log_softmax(per_head, dim=-1), dim=2) - math.log(h // h_kv)
        # Rows with an empty residual are all NaN (softmax of nothing).
        return torch.where(residual, log_p, -torch.inf).nan_to_num(nan=-torch.inf)


# ------------------------------------------------------------------------------- hash generator
_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x·c) mod 2^32`` for ``0 <= x, c < 2^32``: the int64 product may wrap, but its low 32 bits
    are exact."""
    return (x * c) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser ("lowbias32", C. Wellons): full avalanche, bijective."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


# Element ids of KV head h start at h·2^24: a row's entries (tokens or pages) stay below that.
_HEAD_STREAM = 1 << 24


def hash_uniform(state: Tensor, elements: Tensor) -> Tensor:
    """Counter-based uniforms in (0, 1) with 53 random bits, ``float64``, one per element id.

    Element ``i`` (an int64 id in ``elements``) of draw ``c`` (``state = [seed_lo, seed_hi, c]``)
    hashes ``(seed, c, 2i)`` and ``(seed, c, 2i + 1)`` into two 32-bit words: the same id gives the
    same uniform within a draw, whatever the tensor's shape. Plain int64 tensor ops, so it traces
    into a compiled graph and replays in a CUDA graph (the caller advances ``c`` in place).
    """
    key = _mix32(_mix32(_mix32(state[0]) ^ state[1]) ^ _mix32(state[2] & _MASK32))
    idx = elements.to(torch.int64)
    words = []
    for j in (0, 1):
        x = ((2 * idx + j) & _MASK32) ^ key
        words.append(_mix32((_mix32(x) + key) & _MASK32))
    bits = (words[0] >> 5) * 67108864 + (words[1] >> 6)  # 27 + 26 bits
    return (bits.double() + 0.5) * 2.0**-53


# ----------------------------------------------------------------------------------- helpers
def _entry_mask(sel: Selection, n: int) -> Tensor:
    """``bool[B, H_kv, n]``: entries (not tokens) of ``sel`` within ``count``."""
    ok = sel.entry_valid()
    idx = torch.where(ok, sel.indices.long(), n)
    mask = torch.zeros(*sel.indices.shape[:2], n + 1, dtype=torch.bool, device=sel.indices.device)
    return mask.scatter_(2, idx, True)[..., :n]


def inclusion_with_replacement(log_p: Tensor, m: Tensor | int) -> Tensor:
    """``log π = log(1 − (1 − p)^m)``, computed as ``log(−expm1(m·log1p(−p)))`` (exact for tiny p)."""
    p = log_p.exp()
    return torch.log(-torch.expm1(m * torch.log1p(-p)))


def inclusion_gumbel_topk(log_p: Tensor, kappa: Tensor) -> Tensor:
    """``log π(κ) = log(1 − exp(−exp(log p − κ)))``: conditional inclusion of Gumbel-top-k."""
    return torch.log(-torch.expm1(-torch.exp(log_p - kappa)))


def _draw_with_replacement(
    log_p: Tensor, residual: Tensor, m: int, m_row: Tensor, u: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``m`` i.i.d. draws per row by inverse CDF (``u [B, H_kv, m]`` uniforms); returns the unique hits at static width ``m``:
    ``(indices int64[B, H_kv, m], ok bool[...], log π float64[...])``."""
    b, h_kv, n = log_p.shape
    p = log_p.exp()
    cdf = p.cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, u * total, right=True)
    # Float rounding may put u at or past the last cumulative value: fold onto the last positive entry.
    last = torch.where(p > 0, torch.arange(n, device=p.device), 0).amax(-1, keepdim=True)
    idx = torch.minimum(idx, last)
    slots = torch.arange(m, device=p.device)
    drawn = (slots < m_row[:, :, None] if m_row.dim() == 2 else slots < m_row) & (total > 0)
    hit = torch.zeros(b, h_kv, n + 1, dtype=torch.bool, device=p.device)
    hit = hit.scatter_(2, torch.where(drawn, idx, n), True)[..., :n] & residual
    # Unique hits at a static width m (a hit ranks 1, the rest 0; at most m hits).
    _, samp_idx = torch.topk(hit.to(torch.float32), m, dim=-1)
    samp_ok = torch.arange(m, device=p.device) < hit.sum(-1, keepdim=True)
    log_pi = inclusion_with_replacement(torch.gather(log_p, 2, samp_idx), m_row[:, :, None].double())
    return samp_idx, samp_ok, log_pi


def _draw_gumbel_topk(
    log_p: Tensor, residual: Tensor, m: int, m_row: Tensor, u: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The top ``m_row`` of ``log p + Gumbel`` per row (``u [B, H_kv, N]`` uniforms in (0, 1)), with
    the conditional ``log π(κ)``."""
    b, h_kv, n = log_p.shape
    gumbel = -torch.log(-torch.log(u.clamp(max=1.0 - 2.0**-53)))
    keys = torch.where(residual, log_p + gumbel, -torch.inf)
    k = min(m + 1, n)
    top, top_idx = torch.topk(keys, k, dim=-1)
    if k < m + 1:  # fewer entries than m + 1: the missing keys are -inf
        pad = m + 1 - k
        top = torch.cat([top, top.new_full((b, h_kv, pad), -torch.inf)], -1)
        top_idx = torch.cat([top_idx, top_idx.new_zeros((b, h_kv, pad))], -1)
    mr = m_row[:, :, None].expand(b, h_kv, 1)
    kappa = torch.gather(top, 2, mr)  # the (m_row + 1)-th largest key
    samp_idx = top_idx[..., :m]
    samp_ok = (torch.arange(m, device=log_p.device) < mr) & (top[..., :m] > -torch.inf)
    log_p_s = torch.gather(log_p, 2, samp_idx)
    # One draw is a categorical draw: its marginal π = p is exact and, unlike the conditional π(κ)
    # (whose estimator has infinite variance for m = 1: E[1/π(κ)] diverges), has finite variance.
    log_pi = torch.where(mr == 1, log_p_s, inclusion_gumbel_topk(log_p_s, kappa))
    return samp_idx, samp_ok, log_pi


def _merge(det: Selection, samp_idx: Tensor, samp_ok: Tensor, log_pi: Tensor, block: int) -> Selection:
    """Deterministic entries (weight 0) then unique sampled ones (weight ``−log π``), compacted."""
    idx = torch.cat([det.indices.long(), samp_idx], -1)
    ok = torch.cat([det.entry_valid(), samp_ok], -1)
    lw = torch.cat([torch.zeros_like(det.indices, dtype=torch.float32), (-log_pi).float()], -1)
    order = torch.sort((~ok).to(torch.uint8), dim=-1, stable=True).indices
    idx, ok, lw = (torch.gather(t, 2, order) for t in (idx, ok, lw))
    return Selection(
        indices=torch.where(ok, idx, 0).int(),
        count=ok.sum(-1).int(),
        log_weight=torch.where(ok, lw, 0.0),
        block=block,
    )
