"""The decode-step cache append's specification, and the page summaries it keeps, in plain torch."""

from __future__ import annotations

import torch
from torch import Tensor


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
            they are key values), mean and std rounded to theirs from fp32.
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

