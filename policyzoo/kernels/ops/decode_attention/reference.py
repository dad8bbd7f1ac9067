"""Decode attention's specification: softmax and 1.5-entmax attention of one query token over the
selected cache entries, in plain torch.

Shapes use ``B`` batch rows, ``H`` query heads, ``H_kv`` KV heads (``G = H // H_kv`` query heads per
group), ``N`` cache slots, ``D`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....selection import Selection
from ...visibility import visible


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


def dense_probs(q: Tensor, keys: Tensor, start: Tensor, length: Tensor, scale: float) -> Tensor:
    """``float32[B, H, N]``: dense softmax of one query token over every visible slot."""
    b, h, d = q.shape
    h_kv = keys.shape[1]
    qg = q.float().view(b, h_kv, h // h_kv, d)
    logits = torch.einsum("bkgd,bknd->bkgn", qg, keys.float()) * scale
    token_valid = visible(start, length, keys.shape[2])
    logits = logits.masked_fill(~token_valid[:, None, None, :], -torch.inf)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).reshape(b, h, -1)

