"""Which cache slots a row sees: the visibility rule every reference shares."""

from __future__ import annotations

import torch
from torch import Tensor


def visible(start: Tensor, length: Tensor, n: int) -> Tensor:
    """``bool[B, n]``: slot ``t`` of row ``b`` is visible iff ``start[b] <= t < length``."""
    pos = torch.arange(n, device=start.device)
    return (pos >= start[:, None]) & (pos < length)

