"""The key sketch and its page bound's specification, in plain torch.

A 4-bit copy of every key on its page's min/max grid: channel ``i`` of a key on page ``p`` is coded
``c = round((k_i - min_pi) / step_pi)`` in ``0..15`` with ``step_pi = (max_pi - min_pi) / 15``, so
``|k_i - (min_pi + c·step_pi)| <= step_pi / 2``. Two codes share a byte (channel ``j`` in the low
nibble, channel ``j + ceil(D/2)`` in the high one). The grid is the page's min and max, which a page
policy reads anyway; the codes are a quarter of the keys' bf16 bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...visibility import visible

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


def half2_slack_factor(d: int) -> float:
    """The factor on ``15·Σ_i |q_i|·step_i`` of the ``"half2"`` kernel's slack (`half2_slack`): every
    fp16 rounding of a weight (``u``) and of a chain of eight fmas (``8u(1+u)^9``, under ``8.04u``),
    and the fp32 sums (``D`` roundings of ``2^-24`` at most), ``u = 2^-11``."""
    return 9.1 * 2.0**-11 + d * 2.0**-24


def half2_slack(q: Tensor, page_min: Tensor, page_max: Tensor, scale: float, agg: str = "none") -> Tensor:
    """What the ``"half2"`` kernel adds to its sums of fp16 products so that its bound stays above
    `sketch_page_bound`: ``scale·15·half2_slack_factor(D)·Σ_i |q_i|·step_i`` per page and query head,
    ``float32[B, H, P]`` (the group's max ``[B, H_kv, P]`` with ``agg="max"``). The kernel's bound lies
    between the reference's and the reference's plus twice this (and a few fp32 roundings)."""
    b, h, d = q.shape
    h_kv = page_min.shape[1]
    step = sketch_grid(page_min, page_max)[1]  # [B, H_kv, P, D]
    weights = torch.einsum("bkgd,bkpd->bkgp", q.float().abs().view(b, h_kv, h // h_kv, d), step)
    slack = (15 * half2_slack_factor(d) * scale) * weights
    return slack.reshape(b, h, -1) if agg == "none" else slack.amax(2)


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

