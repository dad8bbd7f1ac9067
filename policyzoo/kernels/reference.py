"""Plain-torch reference implementations: the specification every kernel is tested against.

Shapes use ``B`` batch rows, ``H`` query heads, ``H_kv`` KV heads (``G = H // H_kv`` query heads per
group), ``N`` cache slots, ``D`` head dim, ``P`` pages.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..selection import Selection

_SQRT_2PI = math.sqrt(2.0 * math.pi)


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    sel: Selection,
    start: Tensor,
    length: Tensor,
    scale: float,
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention of one query token over the selected cache entries.

    Args:
        q: ``[B, H, D]`` queries (after RoPE / norms).
        keys, values: ``[B, H_kv, N, D]`` cache.
        sel: the selection per (row, KV head); page selections are expanded to tokens.
        start: ``int64[B]``, first real slot of each row (left padding before it).
        length: 0-dim ``int64``, slots written so far; slots ``start[b] .. length-1`` are visible.
        scale: softmax scale (``1/sqrt(D)`` for most models).
        slots: optional ``int32[B, H_kv, K_max]``, shaped as ``sel.indices``: entry ``i``'s tokens
            are read from rows ``slots[i]·block ..`` of ``keys`` and ``values``, which then hold
            copies of the selected entries (a page cache, `offload.PageCache`), not the whole
            sequence. Visibility still follows the positions ``sel.indices`` names.

    Returns:
        ``(out [B, H, D] in q's dtype, lse float32[B, H])``. ``lse`` is the log of the softmax
        denominator including ``log_weight``; an empty selection gives ``out = 0`` and
        ``lse = -inf`` (never NaN), which the split-K merge treats as a chunk with no mass.
    """
    b, h, d = q.shape
    logits, v_sel = _selected_logits(q, keys, values, sel, start, length, scale, slots)
    lse = torch.logsumexp(logits, dim=-1)  # [B, H_kv, G]
    probs = torch.exp(logits - lse.unsqueeze(-1).clamp(min=-1e30)).nan_to_num(0.0)
    out = torch.einsum("bkgm,bkmd->bkgd", probs, v_sel)
    return out.reshape(b, h, d).to(q.dtype), lse.reshape(b, h)


def visible(start: Tensor, length: Tensor, n: int) -> Tensor:
    """``bool[B, n]``: slot ``t`` of row ``b`` is visible iff ``start[b] <= t < length``."""
    pos = torch.arange(n, device=start.device)
    return (pos >= start[:, None]) & (pos < length)


def page_summaries(k: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Min, max, mean and std over dim -2 of ``k [..., P, D]`` where ``mask`` is true.

    Pages with no visible token get zeros everywhere (policies mask them out by their page counts);
    zeros rather than ±inf keep the Quest bound free of ``0·inf`` NaNs.
    """
    k = k.float()
    n = mask.sum(-2)
    empty = n == 0
    kmin = torch.where(mask, k, torch.inf).amin(-2)
    kmax = torch.where(mask, k, -torch.inf).amax(-2)
    mean = torch.where(mask, k, 0.0).sum(-2) / n.clamp(min=1)
    var = torch.where(mask, (k - mean.unsqueeze(-2)) ** 2, 0.0).sum(-2) / n.clamp(min=1)
    zero = torch.zeros_like(mean)
    return (
        torch.where(empty, zero, kmin),
        torch.where(empty, zero, kmax),
        mean,
        var.sqrt(),
    )


def cache_append(
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    summaries: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    start: Tensor,
    length: Tensor,
    page_size: int,
) -> None:
    """Write one decode token and refresh its page's summaries, in place.

    Args:
        k, v: ``[B, H_kv, 1, D]``, the token's key and value.
        keys, values: ``[B, H_kv, N, D]`` cache; the token goes to slot ``length - 1`` of every row.
        summaries: ``(min, max, mean, std)``, each ``[B, H_kv, N / page_size, D]`` or ``None`` (not
            kept). The page holding the slot gets `page_summaries` over its visible slots
            (``start[b] <= t < length``); min and max are stored in their tensor's dtype (exact:
            they are key values), mean and std in theirs (fp32 in the cache).
        start, length: ``int64[B]`` first visible slot per row, 0-dim ``int64`` slots written.
    """
    slot = (length - 1).reshape(1)
    keys.index_copy_(2, slot, k.to(keys.dtype))
    values.index_copy_(2, slot, v.to(values.dtype))
    if all(s is None for s in summaries):
        return
    b, h, n, d = keys.shape
    page = torch.div(slot, page_size, rounding_mode="floor")
    tile = keys.view(b, h, n // page_size, page_size, d).index_select(2, page)  # [B, H_kv, 1, P, D]
    pos = page * page_size + torch.arange(page_size, device=keys.device)  # [P]
    seen = (pos >= start[:, None]) & (pos < length)  # [B, P]
    stats = page_summaries(tile, seen[:, None, None, :, None].expand_as(tile))
    for dest, value in zip(summaries, stats):
        if dest is not None:
            dest.index_copy_(2, page, value.to(dest.dtype))


def dense_probs(q: Tensor, keys: Tensor, start: Tensor, length: Tensor, scale: float) -> Tensor:
    """``float32[B, H, N]``: dense softmax of one query token over every visible slot."""
    b, h, d = q.shape
    h_kv = keys.shape[1]
    qg = q.float().view(b, h_kv, h // h_kv, d)
    logits = torch.einsum("bkgd,bknd->bkgn", qg, keys.float()) * scale
    token_valid = visible(start, length, keys.shape[2])
    logits = logits.masked_fill(~token_valid[:, None, None, :], -torch.inf)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).reshape(b, h, -1)


def quest_page_bound(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float) -> Tensor:
    """Quest upper bound of ``scale * q·k`` over each page: ``Σ_d max(q_d·min_d, q_d·max_d)``.

    ``q [B, H, D]``, summaries ``[B, H_kv, P, D]`` → ``float32[B, H, P]`` (per query head; the
    caller aggregates over the GQA group).
    """
    b, h, d = q.shape
    h_kv = page_min.shape[1]
    qg = q.float().view(b, h_kv, h // h_kv, 1, d)
    lo = qg * page_min.float().unsqueeze(2)
    hi = qg * page_max.float().unsqueeze(2)
    return (torch.maximum(lo, hi).sum(-1) * scale).reshape(b, h, -1)


# --------------------------------------------------------------------------------- key sketch
# A 4-bit copy of every key on its page's min/max grid: channel ``i`` of a key on page ``p`` is coded
# ``c = round((k_i - min_pi) / step_pi)`` in ``0..15`` with ``step_pi = (max_pi - min_pi) / 15``, so
# ``|k_i - (min_pi + c·step_pi)| <= step_pi / 2``. Two codes share a byte (channel ``j`` in the low
# nibble, channel ``j + ceil(D/2)`` in the high one). The grid is the page's min and max, which a page
# policy reads anyway; the codes are a quarter of the keys' bf16 bytes.
SKETCH_LEVELS = 15


def sketch_grid(page_min: Tensor, page_max: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(low, step, radius)``, fp32 and shaped as the summaries: the grid's origin and spacing per page
    and channel, and how far a decoded key may sit from the key it codes.

    The radius is half a step, widened by a few fp32 roundings of the encode and the decode (the
    division, the product and the sum, each within 2^-24 relative), so that it bounds the coding
    error as computed, not only in exact arithmetic."""
    low = page_min.float()
    step = (page_max.float() - low) / SKETCH_LEVELS
    radius = step * (0.5 + 2.0**-12) + 2.0**-20 * torch.maximum(low.abs(), page_max.float().abs())
    return low, step, radius


def sketch_encode(k: Tensor, page_min: Tensor, page_max: Tensor) -> Tensor:
    """``uint8[..., T, ceil(D/2)]``: the 4-bit codes of keys ``k [..., T, D]`` on the grid of their
    page, ``page_min``/``page_max [..., D]`` (keys outside the page's range, e.g. padding, clamp)."""
    low, step, _ = sketch_grid(page_min, page_max)
    low, step = low.unsqueeze(-2), step.unsqueeze(-2)
    c = torch.where(step > 0, (k.float() - low) / torch.where(step > 0, step, 1.0), 0.0)
    c = c.round().clamp(0, SKETCH_LEVELS).to(torch.uint8)
    half = -(-k.shape[-1] // 2)
    c = torch.nn.functional.pad(c, (0, 2 * half - k.shape[-1]))
    return c[..., :half] | (c[..., half:] << 4)


def sketch_decode_codes(codes: Tensor, d: int) -> Tensor:
    """``float32[..., D]``: the codes (``0..15``) that `sketch_encode` packed into ``codes``."""
    both = torch.cat([codes & 15, codes >> 4], dim=-1)
    return both[..., :d].float()


def sketch_token_bound(q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, scale: float) -> Tensor:
    """``float32[B, H, N]``: an upper bound of ``scale·q·k_t`` for every cache slot, from the sketch.

    With the decoded key ``k̂ = min + c·step`` and ``|k - k̂| <= radius`` per channel,
    ``q·k <= q·k̂ + Σ_i |q_i|·radius_i``. Per page that is ``a_p + Σ_i (q_i·step_pi)·c_ti`` with
    ``a_p = q·min_p + |q|·radius_p``: one scalar and one weighted code sum per token. Slots that hold
    no visible key get a number too; callers mask them.

    ``q [B, H, D]``, ``codes uint8[B, H_kv, N, ceil(D/2)]``, summaries ``[B, H_kv, P, D]`` (``N = P·page``).
    """
    b, h, d = q.shape
    h_kv, n_pages = page_min.shape[1], page_min.shape[2]
    low, step, radius = sketch_grid(page_min, page_max)  # [B, H_kv, P, D]
    qg = q.float().view(b, h_kv, h // h_kv, 1, d)
    base = (qg * low.unsqueeze(2)).sum(-1) + (qg.abs() * radius.unsqueeze(2)).sum(-1)  # [B, H_kv, G, P]
    weight = qg * step.unsqueeze(2)  # [B, H_kv, G, P, D]
    c = sketch_decode_codes(codes, d).view(b, h_kv, n_pages, -1, d)  # [B, H_kv, P, page, D]
    coded = torch.einsum("bkgpd,bkptd->bkgpt", weight, c)
    return ((base.unsqueeze(-1) + coded) * scale).reshape(b, h, -1)


def sketch_page_bound(
    q: Tensor, codes: Tensor, page_min: Tensor, page_max: Tensor, start: Tensor, length: Tensor, scale: float,
    agg: str = "none", pages: Tensor | None = None,
) -> Tensor:
    """The best `sketch_token_bound` over each page's visible slots: an upper bound of the page's best
    logit, ``float32[B, H, P]`` per query head (``agg="none"``) or the GQA group's max ``[B, H_kv, P]``
    (``agg="max"``); ``-inf`` on pages with nothing visible.

    With ``pages int[B, H_kv, K]`` the bound of the listed pages alone, ``[B, H, K]`` (``[B, H_kv, K]``
    with ``agg="max"``): entry ``e`` of KV head ``h`` (and of its query heads) is page ``pages[b, h,
    e]``, ``-inf`` for an id outside ``[0, P)``. The kernel then reads the codes of those pages only."""
    if agg not in ("none", "max"):
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    b, h, _ = q.shape
    h_kv, n_pages = page_min.shape[1], page_min.shape[2]
    bound = sketch_token_bound(q, codes, page_min, page_max, scale).view(b, h, n_pages, -1)
    seen = visible(start, length, codes.shape[2]).view(b, 1, n_pages, -1)
    best = bound.masked_fill(~seen, -torch.inf).amax(-1)  # [B, H, P]
    if agg == "max":
        best = best.view(b, h_kv, h // h_kv, n_pages).amax(2)
    if pages is None:
        return best
    if pages.dim() != 3 or tuple(pages.shape[:2]) != (b, h_kv):
        raise ValueError(f"pages must be [B, H_kv, K] = [{b}, {h_kv}, K], got {tuple(pages.shape)}")
    listed = pages.long()
    if agg == "none":  # each query head reads its KV head's list
        listed = listed.repeat_interleave(h // h_kv, dim=1)
    ok = (listed >= 0) & (listed < n_pages)
    return torch.gather(best, 2, listed.clamp(0, n_pages - 1)).masked_fill(~ok, -torch.inf)


def gathered_logits(q: Tensor, keys: Tensor, slots: Tensor, scale: float, agg: str = "none") -> Tensor:
    """``float32[B, H_kv, G, N]``: ``scale·q·k`` of query heads ``q [B, H, D]`` (GQA groups of G
    consecutive heads) against the keys at ``slots int[B, H_kv, N]`` (each in ``[0, capacity)``) of
    ``keys [B, H_kv, capacity, D]``, in fp32; with ``agg="max"`` the group's maximum, ``[B, H_kv, N]``."""
    if agg not in ("none", "max"):
        raise ValueError(f"agg must be 'none' or 'max', got {agg!r}")
    b, h, d = q.shape
    h_kv = keys.shape[1]
    picked = torch.gather(keys, 2, slots.long()[..., None].expand(-1, -1, -1, d))
    logits = torch.einsum("bkgd,bknd->bkgn", q.view(b, h_kv, h // h_kv, d).float(), picked.float()) * scale
    return logits if agg == "none" else logits.amax(2)


# Logits one block of `attention_edges` holds (a block of query rows against their visible keys).
EDGES_BLOCK_ELEMENTS = 2**22


def attention_edges(q: Tensor, keys: Tensor, first: int, scale: float, top: int) -> tuple[Tensor, Tensor]:
    """Each query's ``top`` most attended keys under causal softmax attention → ``(dst, p)``.

    ``q [H, T, D]`` are the queries of local positions ``first, first + 1, ...`` and ``keys [H_kv, n,
    D]`` the keys of positions ``0 .. n-1`` (GQA groups of ``H / H_kv`` consecutive query heads); the
    query at position ``i`` attends to the keys ``0 .. i``. ``dst int32[H, T, top]`` are its best keys
    (largest logit first) and ``p float32[H, T, top]`` their softmax probabilities; where a query sees
    fewer than ``top`` keys, the rest have ``p = 0`` (and any ``dst``). Logits are ``scale·q·k`` in fp32.

    It is the attention graph's edge search (`kv.CommunityKV`): the quadratic part of a prefill. Here
    blocks of query rows hold their logits (`EDGES_BLOCK_ELEMENTS`); the Triton kernel holds a tile.
    """
    h, t, d = q.shape
    h_kv, n = keys.shape[0], keys.shape[1]
    if h % h_kv or first < 0 or first + t > n:
        raise ValueError(f"attention_edges: {h} query heads over {h_kv} KV heads, queries {first}..{first + t} over {n} keys")
    g = h // h_kv
    keys_t = keys.float().transpose(-1, -2)[:, None]  # [H_kv, 1, D, n]
    rows = max(1, EDGES_BLOCK_ELEMENTS // (h * n))
    dsts, probs = [], []
    for lo in range(0, t, rows):
        qb = q[:, lo : lo + rows].float()
        r = qb.shape[1]
        seen = first + lo + r  # the keys the block's last query sees: causal, so no more are read
        logits = torch.matmul(qb.reshape(h_kv, g, r, d), keys_t[..., :seen]) * scale  # [H_kv, G, r, seen]
        later = torch.ones(r, r, dtype=torch.bool, device=q.device).triu_(1)  # only the last r keys can be after a query
        logits[..., seen - r :].masked_fill_(later, -torch.inf)
        best, dst = logits.topk(min(top, seen), dim=-1)
        p = torch.exp(best - logits.logsumexp(-1, keepdim=True))
        pad = top - p.shape[-1]  # a first block that sees fewer than `top` keys: no edge there
        dsts.append(torch.nn.functional.pad(dst.int(), (0, pad)).reshape(h, r, top))
        probs.append(torch.nn.functional.pad(p, (0, pad)).reshape(h, r, top))
    return torch.cat(dsts, 1), torch.cat(probs, 1)


def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None, keep: Tensor) -> Tensor:
    """``F.linear`` over the kept input features only.

    ``keep`` is a bool mask shaped like ``x`` (features not kept count as zero), so the result is
    what a sparse GEMV reading only the kept weight columns computes.
    """
    return torch.nn.functional.linear(x * keep.to(x.dtype), weight, bias)


def _selected_logits(
    q: Tensor, keys: Tensor, values: Tensor, sel: Selection, start: Tensor, length: Tensor, scale: float,
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Logits ``float32[B, H_kv, G, M]`` of the selected tokens (``-inf`` where not visible) and their
    values ``float32[B, H_kv, M, D]``, read at their positions or in their ``slots`` (`decode_attention`)."""
    b, h, d = q.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    pos, entry_valid = sel.token_positions()
    valid = entry_valid & (pos >= start[:, None, None]) & (pos < length)
    rows = pos
    if slots is not None:
        rows = Selection(slots, sel.count, block=sel.block).token_positions()[0]
    idx = rows.clamp(0, n - 1).unsqueeze(-1).expand(-1, -1, -1, d)
    k_sel = torch.gather(keys, 2, idx).float()
    v_sel = torch.gather(values, 2, idx).float()
    logits = torch.einsum("bkgd,bkmd->bkgm", q.float().view(b, h_kv, h // h_kv, d), k_sel) * scale
    if sel.log_weight is not None:
        lw = sel.log_weight.float()
        if sel.block > 1:
            lw = lw.repeat_interleave(sel.block, dim=-1)
        logits = logits + lw.unsqueeze(2)
    return logits.masked_fill(~valid.unsqueeze(2), -torch.inf), v_sel


def entmax15_threshold(x: Tensor) -> Tensor:
    """Exact 1.5-entmax threshold along the last dim, sort based (Peters et al. 2019, Alg. 2).

    ``x`` holds the *halved* scores ``z/2`` (``-inf`` = not a candidate); returns ``tau`` (keepdim)
    with ``Σ_i max(0, x_i − tau)² = 1``, or ``-inf`` for a row without candidates. Computed in float64
    so that the oracle is well clear of the kernels' fp32 error.
    """
    xs = torch.sort(x.double(), dim=-1, descending=True).values
    finite = torch.isfinite(xs)  # -inf candidates sort last
    top = torch.where(finite[..., :1], xs[..., :1], 0.0)
    xs = torch.where(finite, xs - top, 0.0)  # shift by the max: the support lies within 1 of it
    rho = torch.arange(1, xs.shape[-1] + 1, dtype=xs.dtype, device=xs.device)
    mean = xs.cumsum(-1) / rho
    mean_sq = (xs * xs).cumsum(-1) / rho
    delta = ((1 - rho * (mean_sq - mean * mean)) / rho).clamp(min=0)
    tau = mean - delta.sqrt()  # threshold if the support were the top rho entries
    support = ((tau <= xs) & finite).sum(-1, keepdim=True)
    tau_star = tau.gather(-1, (support - 1).clamp(min=0)) + top
    return torch.where(support > 0, tau_star, -torch.inf).to(x.dtype)


def decode_attention_entmax15(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    sel: Selection,
    start: Tensor,
    length: Tensor,
    scale: float,
    slots: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """1.5-entmax attention of one query token over the selected, visible cache entries.

    Same arguments (``slots`` included) and masking as `decode_attention`. With ``z = scale·q·k + log_weight`` the weights
    are ``p_i = max(0, z_i/2 − tau)²``, ``tau`` chosen so that they sum to one (the ``entmax15`` of
    the ``entmax`` package: ``p = [(α−1)z − tau]_+^{1/(α−1)}`` with α = 1.5); entries outside the
    support get exactly zero weight.

    Returns:
        ``(out [B, H, D] in q's dtype, tau float32[B, H])``; an empty selection gives ``out = 0`` and
        ``tau = -inf`` (no mass, like ``lse`` of the softmax).
    """
    b, h, d = q.shape
    logits, v_sel = _selected_logits(q, keys, values, sel, start, length, scale, slots)
    x = logits * 0.5
    tau = entmax15_threshold(x)
    probs = torch.where(x > tau, (x - tau) ** 2, 0.0)
    out = torch.einsum("bkgm,bkmd->bkgd", probs, v_sel)
    return out.reshape(b, h, d).to(q.dtype), tau.reshape(b, h)


def quest_page_bound_grouped(
    q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "max"
) -> Tensor:
    """`quest_page_bound` aggregated over the query heads of each GQA group → ``float32[B, H_kv, P]``.

    ``agg="max"`` (a page bound for the group: any head may want the page) or ``"sum"``.
    """
    b, h, _ = q.shape
    h_kv = page_min.shape[1]
    bound = quest_page_bound(q, page_min, page_max, scale).view(b, h_kv, h // h_kv, -1)
    if agg == "max":
        return bound.amax(2)
    if agg == "sum":
        return bound.sum(2)
    raise ValueError(f"agg must be 'max' or 'sum', got {agg!r}")


def sparse_gemv_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """`sparse_linear` over the input features listed in ``idx``.

    ``x [B, d_in]``, ``idx int[B, k]`` (distinct features per row), ``w_t [d_in, d_out]`` the
    input-major (transposed) weight → ``[B, d_out]`` in x's dtype.
    """
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx.long(), True)
    return sparse_linear(x, w_t.t(), bias, keep)


def sparse_gemv_threshold(
    x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None, segment: int = 0
) -> Tensor:
    """`sparse_linear` over the inputs with ``|x| >= t``, compared in fp32, like
    `Threshold.keep_mask`. ``t``: a scalar, ``[B, 1]`` (per row) or ``[1, d_out]`` (per output
    column, constant over runs of ``segment`` columns: each run is its own projection)."""
    t = torch.as_tensor(t, device=x.device, dtype=torch.float32)
    mags = x.abs().float()
    if t.dim() < 2 or t.shape[1] == 1:
        return sparse_linear(x, w_t.t(), bias, mags >= t)
    runs = range(0, w_t.shape[1], segment)
    return torch.cat(
        [sparse_linear(x, w_t[:, c : c + segment].t(), None if bias is None else bias[c : c + segment], mags >= t[:, c])
         for c in runs],
        dim=-1,
    )


def select_top(scores: Tensor, count: Tensor, k_max: int, absolute: bool = False) -> Tensor:
    """``int32[R, k_max]``: per row of ``scores [R, N]``, the positions of its ``count[r]`` largest
    entries (of ``|scores|`` with ``absolute``), in ascending order, then zeros.

    ``count`` is clamped to ``[0, min(k_max, N)]``. Ties at the boundary go to the lower position.
    Scores must not be NaN (``-inf`` and ``+inf`` are fine: callers force entries with ``+inf``).
    Ascending positions keep the reads of a selection in memory order.
    """
    s = (scores.abs() if absolute else scores).float()
    r, n = s.shape
    k = min(k_max, n)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]  # stable: ties by position
    rank = torch.arange(k, device=s.device)
    taken = rank < count.clamp(0, k).to(s.device)[:, None]
    idx = torch.where(taken, order, n).sort(dim=-1).values  # the sentinel n sorts after every position
    idx = torch.where(taken, idx, 0).int()
    return torch.nn.functional.pad(idx, (0, k_max - k))


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

    The pooled threshold of `kv.EntmaxKV`; the Triton kernel is ``entmax_threshold.py``.
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


def page_fetch(
    src_keys: Tensor, src_values: Tensor, dst_keys: Tensor, dst_values: Tensor,
    src_pages: Tensor, dst_pages: Tensor, count: Tensor, page_size: int,
) -> None:
    """Copy pages of ``src_keys, src_values [..., N, D]`` into pages of ``dst_keys, dst_values [..., S, D]``,
    in place: list entry ``i < count`` copies flat source page ``src_pages[i]`` (rows
    ``src_pages[i]·page_size ..`` of the source viewed as ``[rows, D]``) to flat destination page
    ``dst_pages[i]``. Entries at or past ``count`` may be copied too (this reference copies every entry
    without reading ``count``), so a caller points them at a scratch page nothing reads.
    ``src_pages, dst_pages int64[M]``, ``count int64[1]``."""
    d = src_keys.shape[-1]
    for src, dst in ((src_keys, dst_keys), (src_values, dst_values)):
        pages = dst.view(-1, page_size, d)
        pages.index_copy_(0, dst_pages, src.reshape(-1, page_size, d).index_select(0, src_pages).to(dst.dtype))
