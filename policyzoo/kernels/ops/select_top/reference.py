"""`select_top`'s specification, in plain torch: a stable sort."""

from __future__ import annotations

import torch
from torch import Tensor


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

