"""The Quest page bound's specification, in plain torch."""

from __future__ import annotations

import torch
from torch import Tensor


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

